"""Peak memory numbers cheap enough to take on every step of a real run.

The tracker costs a Python call per op; the trainer cannot leave it on. These cost a syscall or two per step:
on CUDA the allocator's peak (reset at step start), on CPU the process's peak resident set size, which Linux
lets us reset per step (writing 5 to /proc/self/clear_refs resets both VmHWM and getrusage's ru_maxrss).
"""

from __future__ import annotations

import resource
import sys

import torch


def process_peak_rss_bytes() -> int:
    """This process's peak resident set size, in bytes (getrusage reports KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS to the current RSS (Linux only); False when that is not possible.

    This is process-wide: anything else reading the peak RSS of this process sees the reset too.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class StepPeak:
    """Peak bytes between `start()` and `stop()`: CUDA allocated bytes, or process RSS on CPU.

    On CPU without a resettable peak (not Linux), `per_step` is False and `stop()` returns the process-wide
    high-water mark instead.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.per_step = True

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.per_step = reset_peak_rss()

    def stop(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return process_peak_rss_bytes()
