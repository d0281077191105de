"""The tracker's allocation log: a real CPU training step's storages, replayed through the allocator
model, peak where the tracker says the step peaked."""

from __future__ import annotations

import torch
from torch import nn

from memtrain.memory import MemoryTracker
from memtrain.memory.caching_allocator import replay


def test_logged_step_replays_to_the_trackers_peak() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64))
    optimizer = torch.optim.AdamW(model.parameters())
    data = torch.randn(32, 64)
    with MemoryTracker(model, optimizer) as tracker:
        for step in range(2):  # the second step starts with optimizer states and frees last step's grads
            optimizer.zero_grad(set_to_none=True)
            before = tracker.live_bytes
            tracker.begin_step(step)
            log = tracker.record_allocations()
            with tracker.phase("forward"):
                loss = model(data).square().mean()
            with tracker.phase("backward"):
                loss.backward()
            with tracker.phase("optimizer"):
                optimizer.step()
            del loss
            report = tracker.end_step()
    replayed = replay(log.events)
    assert replayed.allocated_peak + before == report.peak_bytes
    frees = [sid for sid, n in log.events if n == 0]
    assert frees and len(set(frees)) == len(frees)  # every storage released once
    grads = {sid for sid, n in log.events if n} & log.gradients  # this step's: one per parameter
    assert sorted(n for sid, n in log.events if sid in grads) == sorted(
        p.numel() * 4 for p in model.parameters()
    )
    view = data.view(-1)  # a view shares its storage: no entry of its own
    with MemoryTracker(None) as viewer:
        log = viewer.record_allocations()
        _ = view.reshape(32, 64).t().add(0)
    assert [n for _, n in log.events if n] == [32 * 64 * 4, 32 * 64 * 4]  # `data` seen as input, then the sum


def test_storages_that_die_together_are_logged_oldest_first() -> None:
    # A list's items die last to first (and a set's in address order, which differs between runs): the
    # log orders the frees of one moment by when each storage was made, so the planner's two traces of one
    # step (two micro-batch sizes) log the same sequence and their sizes fit as a line (the hole: the
    # frees followed the callbacks' order, the two traces often differed, and the reserved model fell back
    # to the larger trace's sizes for every micro-batch, 1.5 GiB more for the 8B QLoRA plan; and which
    # way a run went changed from run to run).
    base = torch.ones(8)
    with MemoryTracker(None) as tracker:
        log = tracker.record_allocations()
        made = [base.add(i) for i in range(1, 5)]
        serials = [sid for sid, n in log.events if n]
        del made  # the list frees its last item first
        _ = base.add(0)  # the next op applies the queued frees
    frees = [sid for sid, n in log.events if n == 0]
    assert frees[:4] == serials[1:5], log.events  # serials[0]: `base`, seen as the first op's input
