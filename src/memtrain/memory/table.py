"""The five components at the peak as a fixed-width table, for logs and the CLI.

Apart from report.py so that the plots can embed it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .values import COMPONENTS, StepMemory, format_bytes


def format_table(report: StepMemory | Mapping[str, Any]) -> str:
    """The five components at the peak, in GiB and percent; takes a StepMemory or a `memory_json` dict."""
    if isinstance(report, StepMemory):
        at_peak, peak, phase, module = (
            report.at_peak,
            report.peak_bytes,
            report.peak_phase,
            report.peak_module,
        )
    else:
        at_peak, peak = report["at_peak"], report["peak_bytes"]
        phase, module = report["peak_phase"], report["peak_module"]
    rows = [f"{'component':<18}{'GiB':>10}{'%':>8}{'':>3}{'bytes':<12}"]
    for c in COMPONENTS:
        share = 100 * at_peak[c] / peak if peak else 0.0
        rows.append(f"{c:<18}{at_peak[c] / 2**30:>10.3f}{share:>8.1f}{'':>3}{format_bytes(at_peak[c]):<12}")
    where = f"{phase}, {module}" if module else phase
    rows.append(f"{'peak':<18}{peak / 2**30:>10.3f}{100.0:>8.1f}{'':>3}{format_bytes(peak)} ({where})")
    return "\n".join(rows)
