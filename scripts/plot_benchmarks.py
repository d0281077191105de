"""PNG plots for docs/BENCHMARKS.md from the JSON the issue-7 benchmarks write, so the figures in the docs
are redrawn from measured files rather than by hand:

- `--peers results/peers.json` (scripts/bench_vs_peers.py): memory by component at each tool's tracked
  peak, one stacked bar per tool;
- `--accuracy results/accuracy.json` (scripts/estimator_accuracy.py): each estimator's predicted peak
  against the measured one, one point per plan, with the y = x line;
- `--fit results/fit.json` (scripts/bench_fit_budget.py, GPU): tokens per step and tokens/s against the
  budget, one line per tool.

    .venv/bin/python scripts/plot_benchmarks.py --peers results/peers_quick.json --out docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "other")
MiB = 2**20


def plot_peers(data: dict[str, Any], path: Path) -> None:
    tracked = data["tracked"]
    tools = [t for t in tracked if tracked[t].get("tracker_peak_bytes")]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    bottoms = [0.0] * len(tools)
    for component in COMPONENTS:
        values = [tracked[t]["tracker_at_peak"].get(component, 0) / MiB for t in tools]
        ax.bar(tools, values, bottom=bottoms, label=component.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("MiB at the tracked peak")
    setup = data["setup"]
    ax.set_title(
        f"Memory by component, {setup['model']}, {setup['global_batch']} x {setup['seq_len']} tokens, "
        f"{setup['precision']} ({data['device']})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_accuracy(data: dict[str, Any], path: Path) -> None:
    rows = data["rows"]
    measured = [r["measured"]["peak"] / MiB for r in rows]
    series = {
        "memtrain planner": [r["planner"]["peak"] / MiB if r["planner"] else None for r in rows],
        "strategies' sum": [r["strategies"]["peak"] / MiB for r in rows],
        "accelerate estimate-memory": [r["accelerate"] / MiB if r["accelerate"] else None for r in rows],
        "DeepSpeed ZeRO-2": [r["deepspeed_zero2"] / MiB if r["deepspeed_zero2"] else None for r in rows],
        "DeepSpeed ZeRO-3": [r["deepspeed_zero3"] / MiB if r["deepspeed_zero3"] else None for r in rows],
    }
    fig, ax = plt.subplots(figsize=(5.5, 4.2), dpi=100)
    markers = iter("o^sDv")
    top = max(measured)
    for name, values in series.items():
        points = [(m, v) for m, v in zip(measured, values, strict=True) if v is not None]
        if points:
            ax.scatter(*zip(*points, strict=True), label=name, marker=next(markers), s=22)
            top = max(top, max(v for _, v in points))
    ax.plot([0, top * 1.05], [0, top * 1.05], color="grey", linewidth=0.8, label="predicted = measured")
    which = "allocated" if data["cuda"] else "tracker"
    ax.set_xlabel(f"measured peak MiB ({which})")
    ax.set_ylabel("predicted peak MiB")
    ax.set_title(
        f"Predicted vs measured, {data['settings']['model']}, {len(rows)} plans ({data['device']})",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_fit(data: dict[str, Any], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.4), dpi=100)
    for tool, fits in data["results"].items():
        budgets = [f["budget_gib"] for f in fits]
        left.plot(budgets, [f["tokens_per_step"] for f in fits], marker="o", label=tool)
        right.plot(budgets, [f["tokens_per_s"] for f in fits], marker="o", label=tool)
    left.set_xlabel("budget GiB")
    left.set_ylabel("tokens per step (one micro-batch)")
    right.set_xlabel("budget GiB")
    right.set_ylabel("tokens/s")
    left.legend(fontsize=7)
    fig.suptitle(
        f"Fit under a budget: {data['probe']['model']}, seq {data['probe']['seq_len']} ({data['device']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, help="scripts/bench_vs_peers.py --json output")
    parser.add_argument("--accuracy", type=Path, help="scripts/estimator_accuracy.py --json output")
    parser.add_argument("--fit", type=Path, help="scripts/bench_fit_budget.py --json output")
    parser.add_argument("--suffix", default="cpu", help="appended to each file name (cpu, h200, ...)")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = (
        (args.peers, plot_peers, "peers_memory_components"),
        (args.accuracy, plot_accuracy, "estimator_accuracy"),
        (args.fit, plot_fit, "fit_budget"),
    )
    for source, plot, name in jobs:
        if source is not None:
            path = args.out / f"{name}_{args.suffix}.png"
            plot(json.loads(source.read_text()), path)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
