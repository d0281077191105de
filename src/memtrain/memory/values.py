"""The names and values every part of memtrain.memory shares.

They live apart from the tracker so that reports, plots and the trainer can read step records (for example
from a JSONL file) without importing the machinery that produced them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

COMPONENTS: tuple[str, ...] = ("weights", "gradients", "optimizer_states", "activations", "other")
"""Where live bytes go. `other` holds buffers, inputs and temporaries (including gradients of activations)."""

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer", "other")
"""What the step is doing; `other` is everything outside an explicit phase."""


@dataclass(frozen=True)
class StepMemory:
    """What one training step did to memory, as counted by the tracker (bytes of live tensor storages)."""

    step: int
    peak_bytes: int
    at_peak: dict[str, int]
    """The five COMPONENTS at the peak moment; they sum to peak_bytes."""
    peak_phase: str
    peak_module: str
    """Qualified name (relative to the tracked model) of the innermost module running at the peak, or ""."""
    phase_peaks: dict[str, int]
    """Highest live bytes seen in each phase the step entered."""
    live_bytes_end: int
    phase_growth: dict[str, dict[str, int]]
    """Net bytes each component gained (negative: lost) while in each phase; explains lazy state creation."""
    component_peaks: dict[str, int] = dataclasses.field(default_factory=dict)
    """The most bytes each component held at any moment of the step (the estimates predict these)."""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, one line of a per-step JSONL log."""
        return dataclasses.asdict(self)


def format_bytes(n: int) -> str:
    """Bytes in the unit CUDA's own messages would pick (B, KiB, MiB, GiB), two decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"
