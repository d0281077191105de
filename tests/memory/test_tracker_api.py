"""The tracker's lifecycle: misuse is reported, and it can be entered again across steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memtrain.memory import MemoryTracker


def _step(tracker: MemoryTracker, model: nn.Module, step: int) -> None:
    tracker.begin_step(step)
    with tracker.phase("forward"):
        loss = model(torch.ones(4, 8)).sum()
    with tracker.phase("backward"):
        loss.backward()
    del loss
    model.zero_grad()
    tracker.end_step()


def test_reentering_across_steps() -> None:
    model = nn.Linear(8, 8)
    tracker = MemoryTracker(model)
    with tracker:
        _step(tracker, model, 1)
    torch.ones(1000)  # untracked
    with tracker:
        _step(tracker, model, 2)
    assert [r.step for r in tracker.reports] == [1, 2]
    assert tracker.reports[0].peak_bytes == tracker.reports[1].peak_bytes


def test_misuse_is_reported() -> None:
    tracker = MemoryTracker(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="inside `with tracker:`"):
        tracker.begin_step(1)
    with tracker:
        with pytest.raises(RuntimeError, match="already active"), tracker:
            pass
        with pytest.raises(RuntimeError, match="without begin_step"):
            tracker.end_step()
        with pytest.raises(ValueError, match="unknown phase 'forwards'"), tracker.phase("forwards"):
            pass
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        MemoryTracker(None, budget_bytes=-1)


def test_only_storages_on_the_tracked_device_count() -> None:
    model = nn.Linear(8, 8)
    with MemoryTracker(model, device="meta") as tracker:
        kept = torch.empty(100, device="meta"), torch.empty(100)
        assert tracker.live_bytes == 100 * 4  # the meta tensor; the CPU tensor and CPU weights are elsewhere
    del kept


def test_host_counts_real_cpu_storages_beside_the_tracked_device() -> None:
    """The rank trace of a CPU run: its model's storages are fake (meta), its batch real host tensors, which
    the run's tracker counts (host memory is a CPU run's device)."""
    with MemoryTracker(None, device="meta", host=True) as tracker:
        kept = torch.empty(100, device="meta"), torch.empty(100)
        assert tracker.live_bytes == 2 * 100 * 4
    del kept


def test_without_a_timeline_the_step_reports_are_the_same() -> None:
    """`timeline=False` (the planner's traces) draws no samples and changes no number of a step report."""
    reports = []
    for sampled in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        tracker = MemoryTracker(model, timeline=sampled)
        with tracker:
            _step(tracker, model, 1)
        assert bool(tracker.timeline.samples) is sampled
        reports.append(tracker.reports[0])
    assert reports[0] == reports[1]
    assert reports[0].peak_bytes > 0
