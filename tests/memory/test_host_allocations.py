"""HostAllocations (the CPU allocator's own count, through torch.profiler's memory events) against the
tracker on eager steps: the instrument the compiled steps are measured with (tests/planner/
test_compiled_peak.py) must agree with the tracker wherever both can see."""

from __future__ import annotations

import pytest
import torch
import transformers

from memtrain.memory import MemoryTracker
from memtrain.memory.host_allocations import HostAllocations, alive_bytes

from helpers import TINY_LLAMA


def test_counts_allocations_and_frees_made_inside_only() -> None:
    before = torch.ones(1000)
    with HostAllocations() as watch:
        kept = torch.ones(256)  # 1 KiB kept
        gone = torch.ones(1024)  # 4 KiB freed before the end
        del gone
        del before  # made before: its free is not reported
    assert (watch.peak_bytes, watch.end_bytes) == (5120, 1024)
    assert kept.numel() == 256


@pytest.mark.parametrize(("family", "autocast"), [("llama", False), ("qwen2", True)])
def test_an_eager_step_peaks_where_the_tracker_says(family: str, autocast: bool) -> None:
    """Forward, backward and AdamW, two steps (the second with optimizer state): the allocator's peak
    plus what was alive at the start is the tracker's peak, to the byte."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**TINY_LLAMA, "model_type": family})
    model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (4, 64))
    for _ in range(2):
        states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        start = alive_bytes([*model.parameters(), *model.buffers(), ids, *states])
        tracker = MemoryTracker(model, optimizer)
        with tracker, HostAllocations() as watch:
            tracker.begin_step(0)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad()
            tracked = tracker.end_step().peak_bytes
        assert start + watch.peak_bytes == tracked
