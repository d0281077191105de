"""The simulated device budget raises torch.OutOfMemoryError at the allocation that crosses it, not below."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from memtrain.memory import MemoryTracker, SimulatedBudget, StepMemory

from helpers import tracked_step


def test_tensors_from_before_count_but_do_not_fail() -> None:
    before = torch.zeros(500)  # 2000 B, more than the budget
    with SimulatedBudget(1000) as budget:
        flat = before.view(-1)  # first seen here: counted, but it is no allocation
        assert budget.live_bytes == 2000
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 4 B"):
            torch.empty(1)
    del flat


def test_standalone_budget_counts_allocations_and_frees() -> None:
    with SimulatedBudget(1000):
        a = torch.empty(100)  # 400 B
        b = torch.empty(150)  # 600 B: exactly at the budget, allowed
        with pytest.raises(
            torch.OutOfMemoryError, match=r"Tried to allocate 4 B\. Simulated device budget of 1000 B"
        ):
            torch.empty(1)
        del a  # the free is seen: the same allocation now fits
        c = torch.empty(100)
        with pytest.raises(torch.OutOfMemoryError):
            c.resize_(101)  # growing a storage in place is an allocation too
    del b, c


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1))
    return model, torch.optim.Adam(model.parameters())


def _step(tracker: MemoryTracker, model: nn.Module, optimizer: torch.optim.Optimizer, batch: int) -> None:
    tracked_step(tracker, model, optimizer, torch.randn(batch, 64))


def _run(budget: int | None, batch: int = 256) -> StepMemory:
    model, optimizer = _model()
    tracker = MemoryTracker(model, optimizer, budget_bytes=budget)
    with tracker:
        tracker.begin_step(1)
        _step(tracker, model, optimizer, batch)
        return tracker.end_step()


def test_budget_at_peak_fits_and_one_byte_less_raises() -> None:
    peak = _run(None).peak_bytes
    assert _run(peak).peak_bytes == peak
    with pytest.raises(torch.OutOfMemoryError) as info:
        _run(peak - 1)
    message = str(info.value)
    assert message.startswith("Simulated device out of memory. Tried to allocate ")
    assert "Simulated device budget of " in message
    for component in ("weights", "gradients", "optimizer_states", "activations", "other"):
        assert component in message


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_tracker_is_usable_after_an_oom(phase: str) -> None:
    unlimited = _run(None)
    assert unlimited.peak_phase == "backward"
    budget = unlimited.phase_peaks[phase] - 1  # fails inside `phase`: forward's own peak is below backward's
    model, optimizer = _model()
    tracker = MemoryTracker(model, optimizer, budget_bytes=budget)
    with tracker:
        before = tracker.live_bytes
        tracker.begin_step(1)
        with pytest.raises(torch.OutOfMemoryError):
            _step(tracker, model, optimizer, 256)
        # what a trainer does after an OOM: drop references (here: the failed step's frames), then retry smaller
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        assert tracker.live_bytes == before  # nothing of the failed step survives, saved activations included
        tracker.begin_step(1)
        _step(tracker, model, optimizer, 32)
        retried = tracker.end_step()
    assert retried.peak_bytes <= budget
    assert [r.step for r in tracker.reports] == [1]
