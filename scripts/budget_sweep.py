"""Budget sweep: does every run either finish under its memory budget or get refused before step 1?

Why: a plan predicted a few percent under its real peak runs out of memory in step 1 under a tight budget,
and a run that stops mid-way wastes everything before it (issue 14, item 6). For each family (tiny llama,
gpt2 and qwen2 on the CPU) this measures the unconstrained peak (`memory.track`, no budget: the planner's
fastest plan), then trains with the simulated device budget `memory.budget` at each fraction of that peak
(default 5%, 10%, 20%, ..., 120%). Each run is a child process with a timeout, and is classified:

- `finished`: every step ran and the tracker's measured peak stayed <= the budget;
- `refused`: `PlanError` before step 1 (the planner says no plan fits, with the table);
- `stopped`: an error after step 1 began: the failure this sweep exists to find;
- `over`: finished, but the measured peak passed the budget (cannot happen under the simulated budget,
  which raises at the allocation that would pass it; kept so that a broken budget shows);
- `error`: anything else (before step 1, not a `PlanError`), or the timeout.

Each row also has the plan, the re-plans during the run, and the prediction against the measured peak
for runs that did not re-plan (the planner's accuracy goal: never under by more than 0.5%).

`--optimism 0.05` is fault injection: every activation prediction is made 5% low (the issue's failure),
before step 1 and when re-planning, so runs meet real out-of-memory errors from the simulated budget and
must re-plan (training/replan.py) instead of stopping.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/budget_sweep.py [--families llama,gpt2,qwen2]
        [--fractions 0.05,0.1,0.2,...] [--steps 3] [--timeout 300] [--optimism 0.05]
        [--json results/budget_sweep.json]

Prints a markdown table and writes the JSON; exits 1 when any run stopped mid-way or went over.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 3,
        "n_head": 4,
        "vocab_size": 128,
        "n_positions": 64,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 64,
    },
}
# What the planner may choose (and a run may switch to): fp32 on one CPU rank, the rest open.
STRATEGIES: dict[str, Any] = {
    "precision": "fp32",
    "sharding": "none",
    "checkpointing": "auto",
    "loss": "auto",
    "optimizer_states": ["fp32", "bf16"],
}
FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
RESULT = "budget-sweep-result: "  # prefix of the child's JSON line
FAILURES = ("stopped", "over")


@dataclass
class Run:
    family: str
    fraction: float | None  # None: the unconstrained run that measures the peak
    budget: int | None
    status: str
    steps_done: int = 0
    measured_peak: int | None = None
    predicted_peak: int | None = None  # the plan chosen before step 1
    under_prediction: float | None = None  # (measured - predicted) / measured, runs that did not re-plan
    plan: str = ""
    replans: list[str] = field(default_factory=list)
    error: str = ""


def recipe_dict(family: str, run_dir: Path, steps: int, memory: dict[str, Any]) -> dict[str, Any]:
    """A tiny open recipe: the planner chooses checkpointing, the loss, optimizer states and micro-batches."""
    return {
        "run": {"name": f"sweep-{family}", "output_dir": str(run_dir), "seed": 3},
        "model": {"config": dict(FAMILIES[family])},
        "data": {"source": "synthetic", "seq_len": 32, "synthetic": {"num_samples": 128, "min_len": 8}},
        "batch": {"global_size": 8, "micro_size": "auto"},
        "train": {"steps": steps, "lr": 1e-3, "warmup_steps": 0, "eval_every": 0},
        "checkpoint": {"every": 0, "at_end": False},
        "output": {"progress": "off"},
        "strategies": dict(STRATEGIES),
        "memory": memory,
    }


def train_once(
    family: str, fraction: float | None, budget: int | None, steps: int, run_dir: Path, optimism: float = 0.0
) -> Run:
    """One run in this process, classified (what the child process does). `optimism` > 0 makes every
    activation prediction that much too low (fault injection: the run must re-plan, not stop)."""
    from memtrain.causal_lm.recipe import CausalLMRecipe
    from memtrain.causal_lm.trainer import CausalLMTrainer
    from memtrain.errors import PlanError

    if optimism:
        _predict_low(optimism)

    memory: dict[str, Any] = {"track": True} if budget is None else {"budget": budget}
    run = Run(family, fraction, budget, "error")
    started = False

    class Watched(CausalLMTrainer):
        def train_step(self, step: int) -> dict[str, Any]:
            nonlocal started
            started = True
            return super().train_step(step)

    trainer = Watched(CausalLMRecipe.from_dict(recipe_dict(family, run_dir, steps, memory)))
    try:
        trainer.setup()
        chosen = trainer.plan_result.chosen if trainer.plan_result is not None else None
        run.predicted_peak = chosen.prediction.peak if chosen is not None else None
        result = trainer.fit()
    except PlanError as exc:
        run.status, run.error = ("stopped" if started else "refused"), str(exc).splitlines()[0][:300]
    except Exception as exc:  # every other failure is a row, not the end of the sweep
        run.status = "stopped" if started else "error"
        run.error = f"{type(exc).__name__}: {str(exc)[:300]} | {traceback.format_exc(limit=-3)[-600:]}"
    else:
        run.steps_done = result.steps_done
        run.measured_peak = max(r.peak_bytes for r in trainer.monitor.memory_reports)
        over = budget is not None and run.measured_peak > budget
        run.status = "over" if over else "finished"
    run.plan = trainer.plan.describe() if trainer._plan is not None else ""
    run.replans = [
        f"step {r['step']}: {r['reason']} -> {r['to']['checkpointing']}, loss {r['to']['loss']}, "
        f"micro {r['to']['micro_batching']}"
        for r in trainer.monitor.replans
    ]
    if run.status == "finished" and not trainer.monitor.replans and run.predicted_peak and run.measured_peak:
        run.under_prediction = (run.measured_peak - run.predicted_peak) / run.measured_peak
    return run


def _predict_low(optimism: float) -> None:
    """Every candidate's activations predicted `optimism` too low, before step 1 and when re-planning."""
    from memtrain.training.replan import Correction

    search = importlib.import_module("memtrain.planner.search")  # the module (the package exports a function)
    score, low = search._Evaluation.score, Correction(1.0 - optimism)

    def optimistic(self: Any, plan: Any) -> Any:
        found = score(self, plan)
        return dataclasses.replace(found, prediction=low(found.prediction))

    search._Evaluation.score = optimistic  # type: ignore[method-assign]


def run_child(
    family: str, fraction: float | None, budget: int | None, steps: int, timeout: float, optimism: float = 0.0
) -> Run:
    """`train_once` in a child process (one crash or hang cannot end the sweep)."""
    with tempfile.TemporaryDirectory(prefix="budget-sweep-") as tmp:
        args = json.dumps(
            {
                "family": family,
                "fraction": fraction,
                "budget": budget,
                "steps": steps,
                "dir": tmp,
                "optimism": optimism,
            }
        )
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--child", args],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Run(family, fraction, budget, "error", error=f"timed out after {timeout:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        return Run(family, fraction, budget, "error", error=f"exit {done.returncode}: {done.stderr[-600:]}")
    return Run(**json.loads(lines[-1][len(RESULT) :]))


Runner = Callable[[str, "float | None", "int | None", int], Run]


def sweep(
    families: list[str], fractions: list[float], steps: int, run_one: Runner, progress: bool = True
) -> list[Run]:
    """The unconstrained run of each family, then a run at each fraction of its measured peak;
    `run_one(family, fraction, budget, steps)` runs one (`run_child`, or in this process for tests)."""
    runs: list[Run] = []
    for family in families:
        free = run_one(family, None, None, steps)
        runs.append(free)
        if progress:
            print(
                f"{family}: unconstrained peak {free.measured_peak} ({free.status})",
                file=sys.stderr,
                flush=True,
            )
        if free.measured_peak is None:
            continue
        for fraction in fractions:
            run = run_one(family, fraction, int(free.measured_peak * fraction), steps)
            runs.append(run)
            if progress:
                print(f"{family} {fraction:.0%}: {run.status} {run.error[:120]}", file=sys.stderr, flush=True)
    return runs


def markdown(runs: list[Run]) -> str:
    rows = [
        "| family | budget | status | steps | measured peak | predicted | under by | re-plans | plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        budget = "none" if r.fraction is None else f"{r.fraction:.0%} ({r.budget:,} B)"
        under = f"{r.under_prediction:+.2%}" if r.under_prediction is not None else ""
        detail = r.plan if r.status in ("finished", "over") else r.error[:120]
        rows.append(
            f"| {r.family} | {budget} | {r.status} | {r.steps_done} | {r.measured_peak or ''} | "
            f"{r.predicted_peak or ''} | {under} | {len(r.replans)} | {detail} |"
        )
    counts: dict[str, int] = {}
    for r in runs:
        if r.fraction is not None:
            counts[r.status] = counts.get(r.status, 0) + 1
    unders = [r.under_prediction for r in runs if r.under_prediction is not None]
    worst = f"{max(unders):+.2%}" if unders else "n/a"
    rows.append("")
    rows.append(
        "budgeted runs: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        + f"; worst under-prediction (measured above predicted, runs without a re-plan): {worst}"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help=f"comma-separated, of {list(FAMILIES)}"
    )
    parser.add_argument(
        "--fractions",
        default=",".join(f"{f:g}" for f in FRACTIONS),
        help="budgets as fractions of the unconstrained peak, comma-separated",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--json", type=Path, default=REPO / "results" / "budget_sweep.json")
    parser.add_argument(
        "--optimism",
        type=float,
        default=0.0,
        help="fault injection: predict every plan's activations this fraction too low (e.g. 0.05), so "
        "that runs meet real out-of-memory errors and must re-plan",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        run = train_once(
            spec["family"],
            spec["fraction"],
            spec["budget"],
            spec["steps"],
            Path(spec["dir"]) / "run",
            spec.get("optimism", 0.0),
        )
        print(RESULT + json.dumps(asdict(run)), flush=True)
        return 0
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"--families: unknown {unknown}; known: {list(FAMILIES)}")
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--fractions: not a comma-separated list of numbers: {args.fractions!r}")
    runs = sweep(
        families,
        fractions,
        args.steps,
        functools.partial(run_child, timeout=args.timeout, optimism=args.optimism),
    )
    print(markdown(runs))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    print(f"\nwrote {args.json}")
    return 1 if any(r.status in FAILURES for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
