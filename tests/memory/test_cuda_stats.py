"""The allocator view: clear "unavailable" answers on CPU, real numbers on a GPU (marked `gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memtrain.memory import MemoryTracker, _torch_private, cuda_stats
from memtrain.memory.cuda_stats import AllocatorStats

from helpers import tracked_step

no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answers")


@cpu_only
def test_cpu_answers_are_none_or_reasons(tmp_path: Path) -> None:
    reason = cuda_stats.cuda_unavailable_reason()
    assert reason is not None and "CUDA is not available" in reason and torch.__version__ in reason
    assert cuda_stats.allocator_stats() is None
    assert cuda_stats.context_bytes() is None
    assert cuda_stats.fragmentation_warning() is None
    started = cuda_stats.start_memory_history()
    assert not started.ok and started.detail == reason
    dumped = cuda_stats.dump_memory_history(tmp_path / "snapshot.pickle")
    assert not dumped.ok and not (tmp_path / "snapshot.pickle").exists()


def _stats(inactive_split: int, retries: int = 0) -> AllocatorStats:
    gib = 2**30
    return AllocatorStats(8 * gib, 10 * gib, 8 * gib, 9 * gib, 10 * gib, 9 * gib, retries, 0, inactive_split)


@pytest.mark.parametrize(
    ("settings", "expandable"),
    [
        ("", False),
        ("expandable_segments:True", True),
        ("max_split_size_mb:128,expandable_segments:True", True),
        ("expandable_segments:False", False),
    ],
)
def test_expandable_segments_setting(
    monkeypatch: pytest.MonkeyPatch, settings: str, expandable: bool
) -> None:
    monkeypatch.setattr(_torch_private, "allocator_settings", lambda: settings)
    assert cuda_stats.expandable_segments_enabled() is expandable


def test_fragmentation_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_torch_private, "allocator_settings", lambda: "")
    fragmented = _stats(inactive_split=3 * 2**30)
    assert fragmented.fragmentation == pytest.approx(0.3)
    warning = cuda_stats.fragmentation_warning(fragmented)
    assert warning is not None and "expandable_segments:True" in warning and "30%" in warning
    assert cuda_stats.fragmentation_warning(_stats(inactive_split=2**20)) is None
    assert cuda_stats.fragmentation_warning(_stats(inactive_split=2**20, retries=2)) is not None
    monkeypatch.setattr(_torch_private, "allocator_settings", lambda: "expandable_segments:True")
    assert cuda_stats.fragmentation_warning(fragmented) is None


@pytest.mark.gpu
@no_cuda
def test_cuda_numbers(tmp_path: Path) -> None:
    context = cuda_stats.context_bytes()
    assert context is not None and context > 0
    assert cuda_stats.start_memory_history().ok
    x = torch.empty(2**20, device="cuda")
    stats = cuda_stats.allocator_stats()
    assert (
        stats is not None
        and stats.allocated_bytes >= x.nbytes
        and stats.reserved_bytes >= stats.allocated_bytes
    )
    dumped = cuda_stats.dump_memory_history(tmp_path / "snapshot.pickle")
    assert dumped.ok and (tmp_path / "snapshot.pickle").stat().st_size > 0


@pytest.mark.gpu
@no_cuda
def test_tracker_on_cuda_follows_the_allocator() -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256, device="cuda")
    tracker = MemoryTracker(model, optimizer)
    assert tracker.device.type == "cuda"
    with tracker:
        for step in (1, 2, 3):  # compare on step 3: cuBLAS workspaces and optimizer state exist by then
            torch.cuda.synchronize()
            allocated_before, live_before = torch.cuda.memory_allocated(), tracker.live_bytes
            torch.cuda.reset_peak_memory_stats()
            tracker.begin_step(step)
            tracked_step(tracker, model, optimizer, x)
            report = tracker.end_step()
            torch.cuda.synchronize()
        allocator_growth = torch.cuda.max_memory_allocated() - allocated_before
        tracked_growth = report.peak_bytes - live_before
        allocator_end, tracked_end = (
            torch.cuda.memory_allocated() - allocated_before,
            tracker.live_bytes - live_before,
        )
    # the allocator rounds every block up to 512 B and may hold kernel-internal temporaries the tracker cannot see
    slack = 256 * 1024 + tracked_growth // 50
    assert tracked_growth - slack <= allocator_growth <= tracked_growth + slack
    assert abs(allocator_end - tracked_end) <= slack
    assert report.at_peak["optimizer_states"] == 2 * sum(p.nbytes for p in model.parameters())  # step on CPU
