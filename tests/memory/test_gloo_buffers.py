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
            dist.reduce_scatter_single(out, inp)  # FSDP2's call
        peak = tracker.end_step().peak_bytes
    return peak - held


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


def test_an_async_reduce_scatter_holds_gloos_copy_until_the_next_collective_after_its_wait(
    fake_group: None,
) -> None:
    """Sequence parallelism's reduce-scatter (functional, waited on apart): gloo's copy of the input lives
    while it is in flight, and after the wait until the next collective (as its output would)."""
    tracker = MemoryTracker(None, device="cpu")
    with tracker, GlooBuffers():
        activation = torch.ones(NUMEL)
        before = tracker.live_bytes
        pending = funcol.reduce_scatter_single(activation, "sum", 0, dist.group.WORLD)
        in_flight = tracker.live_bytes - before
        shard = pending.wait()
        del pending, activation
        waited = tracker.live_bytes - before
        funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD).wait()
        after = tracker.live_bytes - before
    assert in_flight == NUMEL * 4 // 2 + NUMEL * 4  # the output and gloo's copy
    assert waited == in_flight - NUMEL * 4  # the input freed, the copy still held
    assert after <= NUMEL * 4 // 2 + 8 and shard.numel() == NUMEL // 2  # the copy released


def test_a_sends_tensor_lives_while_its_work_does(fake_group: None) -> None:
    """A pipeline stage's send: gloo's work refers to the sent tensor, and torch's 1F1B keeps a warm-up send's
    works through its steady phase, so the tensor outlives the caller's last reference until the work dies
    (the fake group's work holds nothing)."""
    tracker = MemoryTracker(None, device="cpu")
    with tracker, GlooBuffers():
        output = torch.ones(NUMEL)
        before = tracker.live_bytes
        works = [dist.isend(output, dst=1)]
        del output
        assert tracker.live_bytes == before  # held by the work
        del works
        torch.ones(1)  # the next op: the tracker counts the free (and the mode lets go of the work it handed)
        assert tracker.live_bytes == before - NUMEL * 4
