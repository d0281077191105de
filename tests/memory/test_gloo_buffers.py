"""`GlooBuffers`: what the rank trace holds for a gloo run that torch's fake process group does not (the
measured cases: tests/parallel/test_rank_trace.py). Real CPU tensors over the fake group, so that the
tracker counts every byte the mode holds."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from memtrain.distributed import collective_backend
from memtrain.memory import MemoryTracker, join_fake_process_group
from memtrain.memory.gloo_buffers import GlooBuffers

NUMEL = 1024  # 4 KiB of fp32


@pytest.fixture
def fake_group() -> Iterator[None]:
    assert not dist.is_initialized()
    join_fake_process_group(0, 2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _extra_peak(gloo: bool) -> int:
    """Bytes a reduce-scatter's step peaks above what its input and output hold, with or without the mode."""
    inp, out = torch.ones(NUMEL), torch.empty(NUMEL // 2)
    tracker = MemoryTracker(None, device="cpu")
    with tracker:
        held = tracker.live_bytes + (NUMEL + NUMEL // 2) * 4  # the arguments, counted when first seen
        tracker.begin_step(0)
        with GlooBuffers() if gloo else nullcontext():
            dist.reduce_scatter_tensor(out, inp)
        peak = tracker.end_step().peak_bytes
    return peak - held


@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor. is deprecated")  # FSDP2 calls it too
def test_a_reduce_scatter_holds_gloos_copy_of_its_input(fake_group: None) -> None:
    """FSDP2's gradient reduce-scatter: gloo clones the input (the fake group allocates nothing)."""
    assert _extra_peak(gloo=False) == 0
    assert _extra_peak(gloo=True) == NUMEL * 4


def test_a_finished_collectives_output_is_held_until_the_next_collective(fake_group: None) -> None:
    """Tensor parallelism's all-reduce: its output outlives its last use until this rank's next collective
    (gloo's thread still holds the work); the input, which the functional all-reduce copies, does not."""
    tracker = MemoryTracker(None, device="cpu")
    with tracker, GlooBuffers():
        grad = torch.ones(NUMEL)
        reduced = funcol.all_reduce(grad, "sum", dist.group.WORLD).wait()
        del grad
        before = tracker.live_bytes
        del reduced
        assert tracker.live_bytes == before  # still held
        funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()
        assert tracker.live_bytes <= before - NUMEL * 4 + 8  # released; only the new, tiny one's held


def test_only_a_cpu_run_uses_gloo() -> None:
    assert collective_backend(torch.device("cpu")) == "gloo"
    assert collective_backend(torch.device("cuda", 0)) == "nccl"
