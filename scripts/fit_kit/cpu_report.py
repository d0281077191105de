"""The CPU fit benchmark's report: medians and spread of the timed runs, and one markdown table per metric
with a budget per column. Every cell holds a figure or the reason there is none.

Why separate: the workers' records (JSON) are the result; the tables are one reading of them, rebuilt
from a saved JSON without rerunning anything (`summarise` + `tables`).
"""

from __future__ import annotations

import statistics
from typing import Any

from fit_kit.cpu_setup import MEMTRAIN_TOOLS, TOOLS

MiB = 2**20


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values) if values else None,
        "min": min(values, default=None),
        "max": max(values, default=None),
        "runs": values,
    }


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Per tool and budget: the three metrics, the timed runs' median / min / max tokens/s (wall and
    CPU time) per method, and the own search's answer."""
    summary: dict[str, Any] = {}
    for tool, records in result["search"].items():
        summary[tool] = {}
        for record in records:
            pct = str(record["budget_pct"])
            runs = [t for t in result["timed"].get(tool, []) if t["budget_pct"] == record["budget_pct"]]
            timed: dict[str, Any] = {}
            for method in sorted({t["method"] for t in runs}):
                mine = [t for t in runs if t["method"] == method]
                ok = [t for t in mine if t["ok"]]
                timed[method] = {
                    "tokens_per_s": spread([t["tokens_per_s"] for t in ok]),
                    "tokens_per_cpu_s": spread([t["tokens_per_cpu_s"] for t in ok]),
                    "micro": ok[0]["micro"] if ok else None,
                    "accumulation": ok[0]["accumulation"] if ok else None,
                    "plan": ok[0]["plan"] if ok else "",
                    "failed": [t["note"] for t in mine if not t["ok"]],
                }
            summary[tool][pct] = {
                "model": record["model"],
                "batch": record["batch"],
                "seq": record["seq"],
                "own": record["own"],
                "timed": timed,
            }
    return summary


def short(note: str, limit: int = 90) -> str:
    """A reason as a table shows it (the JSON keeps it whole)."""
    note = note.replace("|", "/")
    return note if len(note) <= limit else note[: limit - 1] + "…"


def _missing(result: dict[str, Any], tool: str) -> str:
    return result["errors"].get(tool, "no result")


def _cell(result: dict[str, Any], tool: str, pct: int, render: Any) -> str:
    entry = result["summary"].get(tool, {}).get(str(pct))
    return short(_missing(result, tool) if entry is None else str(render(entry)))


def _row(result: dict[str, Any], label: str, tool: str, render: Any) -> str:
    cells = [_cell(result, tool, b["pct"], render) for b in result["budgets"]]
    return f"| {label} | " + " | ".join(cells) + " |"


def _header(result: dict[str, Any], first: str) -> list[str]:
    budgets = [f"{b['pct']}% ({b['bytes'] / MiB:.1f} MiB)" for b in result["budgets"]]
    return [f"| {first} | " + " | ".join(budgets) + " |", "|---|" + "---|" * len(budgets)]


def _model(entry: dict[str, Any]) -> str:
    m = entry["model"]
    if m.get("rung") is None:
        return m["note"]
    top = "≥ " if m.get("at_top") else ""
    return f"{top}{m['params'] / 1e6:.2f}M (h{m['hidden']} x {m['layers']})"


def _seq(entry: dict[str, Any]) -> str:
    s = entry["seq"]
    if s.get("seq_len") is None:
        return s["note"]
    return f"{'≥ ' if s.get('at_top') else ''}{s['seq_len']}"


def _timed(method: str, key: str) -> Any:
    def render(entry: dict[str, Any]) -> str:
        t = entry["timed"].get(method)
        if t is None:
            batch = entry["batch"]
            return batch["note"] if batch.get("micro") is None else "not timed"
        s = t[key]
        if s["median"] is None:
            return "failed: " + "; ".join(t["failed"])[:120]
        return f"{s['median']:.0f} [{s['min']:.0f}–{s['max']:.0f}] ({t['micro']} x {t['accumulation']})"

    return render


def _own(entry: dict[str, Any]) -> str:
    own = entry["own"]
    if not own["ok"]:
        return own["note"]
    attempts = f", {own['attempts']} attempt(s)" if own["attempts"] > 1 else ""
    return f"{own['micro']} x {own['accumulation']}: {own['tokens_per_s']:.0f}{attempts}"


def tables(result: dict[str, Any]) -> list[str]:
    setup, reference = result["setup"], result["reference"]
    tokens = setup["global_batch"] * setup["seq_len"]
    lines = [
        f"Model {setup['base']} ({reference['params'] / 1e6:.2f}M parameters), {setup['seq_len']}-token "
        f"sequences, global batch {setup['global_batch']}; budgets in % of the unconstrained peak "
        f"{reference['peak_bytes'] / MiB:.1f} MiB (the larger tracker peak of the HF Trainer and accelerate "
        "loops, no checkpointing, the global batch in one micro-batch).",
        "",
        f"(a) Largest model that trains: parameters (hidden x layers), one {setup['seq_len']}-token sequence "
        "per step, ladder of width and depth x 2^(1/4) a rung:",
        "",
        *_header(result, "tool"),
        *[_row(result, TOOLS[t], t, _model) for t in result["search"]],
        "",
        f"(b) Tokens/s at the global batch ({tokens} tokens a step), the largest micro-batch (a divisor of "
        f"{setup['global_batch']}) that fits by the common search, x accumulation: median [min–max] over "
        f"{result['reps']} run(s) of {setup['steps']} timed steps; memtrain auto: its own plan:",
        "",
        *_header(result, "tool"),
        *[_row(result, TOOLS[t], t, _timed("common", "tokens_per_s")) for t in result["search"]],
    ]
    lines += _own_choice_rows(result, "tokens_per_s")
    lines += [
        "",
        "(b) The same runs in tokens per CPU-second of the worker (less disturbed by other jobs on the CPU):",
        "",
        *_header(result, "tool"),
        *[_row(result, TOOLS[t], t, _timed("common", "tokens_per_cpu_s")) for t in result["search"]],
    ]
    lines += _own_choice_rows(result, "tokens_per_cpu_s")
    lines += [
        "",
        "(b) Each tool's own search, one run: HF `auto_find_batch_size` and accelerate "
        f"`find_executable_batch_size` from {setup['global_batch']} sequences in one micro-batch (0.9x per "
        "OOM; the global batch shrinks with it), memtrain's planner at the global batch: micro x "
        "accumulation: tokens/s:",
        "",
        *_header(result, "tool"),
        *[_row(result, TOOLS[t], t, _own) for t in result["search"]],
        "",
        "(c) Longest sequence that trains, one sequence per step, the base model (≥: the longest tried):",
        "",
        *_header(result, "tool"),
        *[_row(result, TOOLS[t], t, _seq) for t in result["search"]],
    ]
    for tool in (t for t in MEMTRAIN_TOOLS if t in result["search"]):
        lines += ["", f"{TOOLS[tool]}: its plans at the global batch:", "", "| budget | plan |", "|---|---|"]
        for b in result["budgets"]:
            entry = result["summary"].get(tool, {}).get(str(b["pct"]))
            plan = entry["own"]["plan"] or entry["own"]["note"] if entry else _missing(result, tool)
            lines.append(f"| {b['pct']}% | {short(plan, 200)} |")
    return lines


def _own_choice_rows(result: dict[str, Any], key: str) -> list[str]:
    """A row per memtrain tool: the micro-batch its own planner chose (not the common search's)."""
    return [
        _row(result, f"{TOOLS[tool]}, the micro-batch its planner chose", tool, _timed("auto", key))
        for tool in MEMTRAIN_TOOLS
        if tool in result["search"]
    ]
