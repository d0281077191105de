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
