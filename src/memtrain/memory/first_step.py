"""Why the first step's peak differs from the steady state, read off the step records.

The first step is not representative (torchtitan: 27.2 GiB at step 1, 30.9 GiB later): optimizer state and
gradients kept with `zero_grad(set_to_none=False)` are created lazily during it, and on CUDA the allocator
warms up. Calibration must compare like with like, so this says what differed, from the numbers alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from statistics import median
from typing import Any

from .values import COMPONENTS, StepMemory, format_bytes


def explain_first_step(
    reports: Sequence[StepMemory], device_peaks: Sequence[int] | None = None
) -> dict[str, Any]:
    """Compare `reports[0]` with the median of the later reports; see MemoryTracker.first_step_report."""
    if len(reports) < 2:
        raise ValueError(f"first_step_report needs at least 2 finished steps, got {len(reports)}")
    if device_peaks is not None and len(device_peaks) != len(reports):
        raise ValueError(f"device_peaks has {len(device_peaks)} values for {len(reports)} step reports")
    first, later = reports[0], reports[1:]
    steady_peak = int(median(r.peak_bytes for r in later))
    steady_at_peak = {c: int(median(r.at_peak[c] for r in later)) for c in COMPONENTS}
    deltas = {c: first.at_peak[c] - steady_at_peak[c] for c in COMPONENTS}
    steady_phase = Counter(r.peak_phase for r in later).most_common(1)[0][0]
    lazy = _created_lazily(first, later)

    direction = (
        "above" if first.peak_bytes > steady_peak else "below" if first.peak_bytes < steady_peak else "at"
    )
    lines = [
        f"step {first.step} peaks at {format_bytes(first.peak_bytes)}, {format_bytes(abs(first.peak_bytes - steady_peak))} "
        f"{direction} the steady {format_bytes(steady_peak)} (median of {len(later)} later steps)"
    ]
    if first.peak_phase != steady_phase:
        lines.append(
            f"the peak falls in {first.peak_phase} in step {first.step} but in {steady_phase} afterwards"
        )
    for c in sorted((c for c in COMPONENTS if deltas[c] or c in lazy), key=lambda c: -abs(deltas[c])):
        line = (
            f"{c} at the peak: {format_bytes(first.at_peak[c])} in step {first.step} vs "
            f"{format_bytes(steady_at_peak[c])} steady ({'-' if deltas[c] < 0 else '+'}{format_bytes(abs(deltas[c]))})"
        )
        if c in lazy:
            line += (
                f"; {format_bytes(lazy[c][1])} of {c} were created during step {first.step}'s {lazy[c][0]} phase "
                "and kept, which later steps do not repeat (lazy creation)"
            )
        lines.append(line)
    if device_peaks is not None:
        gaps = [d - r.peak_bytes for d, r in zip(device_peaks, reports, strict=True)]
        steady_gap = int(median(gaps[1:]))
        if gaps[0] != steady_gap:
            lines.append(
                f"the device's own peak minus the tracked peak is {format_bytes(gaps[0])} in step {first.step} "
                f"and {format_bytes(steady_gap)} later: what tensors cannot show (allocator warm-up, caching, "
                f"kernel workspaces) differs by {format_bytes(abs(gaps[0] - steady_gap))}"
            )
    return {
        "first_step": first.step,
        "first_peak_bytes": first.peak_bytes,
        "steady_peak_bytes": steady_peak,
        "delta_bytes": first.peak_bytes - steady_peak,
        "steady_steps": [r.step for r in later],
        "first_peak_phase": first.peak_phase,
        "steady_peak_phase": steady_phase,
        "component_deltas": deltas,
        "created_lazily": {c: {"phase": phase, "bytes": n} for c, (phase, n) in lazy.items()},
        "explanation": lines,
    }


def _created_lazily(first: StepMemory, later: Sequence[StepMemory]) -> dict[str, tuple[str, int]]:
    """Components that grew in a phase of the first step, do not grow there in later steps (median), and
    are still there at the later steps' peaks: state created once, lazily."""
    found: dict[str, tuple[str, int]] = {}
    for phase, growth in first.phase_growth.items():
        for c, n in growth.items():
            again = median(r.phase_growth.get(phase, {}).get(c, 0) for r in later)
            kept = median(r.at_peak[c] for r in later) >= n
            if n > 0 and again <= 0 and kept and n > found.get(c, ("", 0))[1]:
                found[c] = (phase, n)
    return found
