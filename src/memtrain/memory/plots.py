"""Timeline plots: what occupied memory op by op, stacked by component, with phases and the peak marked.

A number says how much; the timeline says when and why (the fp32 logits at the start of backward, the
optimizer's temporaries, step 1's lazy optimizer state). The PNG is for logs and READMEs; the HTML page is
the same figure as inline SVG plus the tables, self-contained so it opens anywhere without a network.
"""

from __future__ import annotations

import html
import io
import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from .first_step import explain_first_step
from .table import format_table
from .timeline import Timeline
from .tracker import MemoryTracker
from .values import COMPONENTS, StepMemory, format_bytes

_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8c8c8c")


def timeline_figure(source: MemoryTracker | Timeline, reports: Sequence[StepMemory] = ()) -> Figure:
    """The stacked-component timeline; with a tracker, its own reports name the peak's module."""
    timeline, reports = _unpack(source, reports)
    samples = timeline.samples
    if not samples:
        raise ValueError(
            "the timeline is empty: record steps with begin_step()/end_step() inside `with tracker:`"
        )
    peak = max(samples, key=lambda s: s.total)
    scale, unit = next(
        (2**p, u) for p, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"), (0, "B")) if peak.total >= 2**p
    )

    fig = Figure(figsize=(11, 5), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    x = [s.t for s in samples]
    series = [[s.bytes[i] / scale for s in samples] for i in range(len(COMPONENTS))]
    ax.stackplot(x, *series, labels=COMPONENTS, colors=_COLORS, alpha=0.85)
    top = peak.total / scale
    phase_starts: dict[int, str] = {}  # the last phase entered at an op index is the one that ran
    for b in timeline.boundaries:
        if b.phase == "step":
            ax.axvline(b.t, color="black", linewidth=1.2)
            ax.text(b.t, top * 1.28, f" step {b.step}", fontsize=8, va="top", fontweight="bold")
        else:
            phase_starts[b.t] = b.phase
    for t, phase in phase_starts.items():
        ax.axvline(t, color="#555555", linewidth=0.7, linestyle=":")
        ax.text(t, top * 1.02, f" {phase}", fontsize=7, rotation=90, va="bottom", color="#333333")
    module = next((r.peak_module for r in reports if r.step == peak.step and r.peak_bytes == peak.total), "")
    where = ", ".join(p for p in (f"step {peak.step}", peak.phase, module) if p)
    ax.annotate(
        f"peak {format_bytes(peak.total)}\n({where})",
        xy=(peak.t, top),
        xytext=(0.55, 0.93),
        textcoords="axes fraction",
        fontsize=8,
        arrowprops={"arrowstyle": "->", "color": "black"},
    )
    ax.set_ylim(0, top * 1.3)
    ax.set_xlabel("tensor op (downsampled, peaks kept)")
    ax.set_ylabel(f"live tensor storage ({unit})")
    ax.set_title("live tensor memory by component, step by step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig


def write_timeline_png(
    source: MemoryTracker | Timeline, path: str | os.PathLike[str], reports: Sequence[StepMemory] = ()
) -> Path:
    """The timeline as a PNG (Agg canvas: no display and no global pyplot state needed)."""
    fig = timeline_figure(source, reports)
    FigureCanvasAgg(fig).print_png(os.fspath(path))
    return Path(path)


def write_timeline_html(
    source: MemoryTracker | Timeline, path: str | os.PathLike[str], reports: Sequence[StepMemory] = ()
) -> Path:
    """The timeline as inline SVG, plus per-step peaks and the first-step explanation (2+ steps)."""
    _, reports = _unpack(source, reports)
    buf = io.StringIO()
    FigureCanvasSVG(timeline_figure(source, reports)).print_svg(buf)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>memtrain memory timeline</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:right}</style>",
        "</head><body><h1>Memory timeline</h1>",
        svg,
    ]
    if reports:
        top = max(reports, key=lambda r: r.peak_bytes)
        parts.append(f"<h2>At the peak (step {top.step})</h2><pre>{html.escape(format_table(top))}</pre>")
        rows = "".join(
            f"<tr><td>{r.step}</td><td>{format_bytes(r.peak_bytes)}</td><td>{html.escape(r.peak_phase)}</td>"
            f"<td>{html.escape(r.peak_module)}</td><td>{format_bytes(r.live_bytes_end)}</td></tr>"
            for r in reports
        )
        parts.append(
            "<h2>Steps</h2><table><tr><th>step</th><th>peak</th><th>phase</th><th>module</th>"
            f"<th>live at end</th></tr>{rows}</table>"
        )
    if len(reports) >= 2:
        lines = "".join(
            f"<li>{html.escape(line)}</li>" for line in explain_first_step(reports)["explanation"]
        )
        parts.append(f"<h2>First step vs steady state</h2><ul>{lines}</ul>")
    parts.append("</body></html>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")
    return Path(path)


def _unpack(
    source: MemoryTracker | Timeline, reports: Sequence[StepMemory]
) -> tuple[Timeline, Sequence[StepMemory]]:
    if isinstance(source, MemoryTracker):
        return source.timeline, reports or source.reports
    return source, reports
