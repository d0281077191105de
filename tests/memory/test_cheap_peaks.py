"""Cheap per-step peaks: peak RSS on CPU, resettable per step on Linux."""

from __future__ import annotations

import sys

import pytest
import torch

from memtrain.memory.cheap import StepPeak, process_peak_rss_bytes

MiB = 2**20


def test_process_peak_rss_is_in_bytes() -> None:
    peak = process_peak_rss_bytes()
    assert 20 * MiB < peak < 64 * 2**30  # a Python process with torch loaded, counted in bytes not KiB


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-step RSS peaks need /proc/self/clear_refs"
)
def test_step_peak_on_cpu_is_per_step() -> None:
    meter = StepPeak("cpu")
    meter.start()
    big = torch.ones(256 * MiB // 4)  # 256 MiB, touched
    with_big = meter.stop()
    del big
    meter.start()
    without = meter.stop()
    assert meter.per_step
    assert with_big >= 256 * MiB
    assert without < with_big - 128 * MiB
