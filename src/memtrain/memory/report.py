"""Memory reports in the forms people and programs read: a JSON summary, a table, timeline plots.

`memory_json`'s schema is a contract with `memtrain profile --json` and the benchmarks; keep it stable.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median
from typing import Any

import torch

from .plots import write_timeline_html, write_timeline_png
from .table import format_table
from .values import COMPONENTS, StepMemory

__all__ = ["format_table", "memory_json", "write_timeline_html", "write_timeline_png"]


def memory_json(reports: Sequence[StepMemory], device: torch.device | str) -> dict[str, Any]:
    """The run's peak (with its components, phase and module), step 1 vs steady state, and every step.

    The steady peak is the median over steps after the first (step 1's own peak when there is one step).
    """
    if not reports:
        raise ValueError("memory_json needs at least one step report")
    top = max(reports, key=lambda r: r.peak_bytes)
    later = reports[1:] or reports
    return {
        "device": str(device),
        "peak_bytes": top.peak_bytes,
        "at_peak": {c: int(top.at_peak[c]) for c in COMPONENTS},
        "peak_phase": top.peak_phase,
        "peak_module": top.peak_module,
        "first_step_peak_bytes": reports[0].peak_bytes,
        "steady_peak_bytes": int(median(r.peak_bytes for r in later)),
        "steps": [
            {"step": r.step, "peak_bytes": r.peak_bytes, "phase_peaks": dict(r.phase_peaks)} for r in reports
        ],
    }
