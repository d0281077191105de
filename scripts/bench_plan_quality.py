"""Plan quality: does the planner's choice train as fast as the best plan that fits?

At a fixed simulated budget (CPU), the planner ranks every allowed plan; this script trains the ten plans
it predicts fastest among those that fit (its choice first) for a few steps each, under that budget, and
measures their step time (median over the steps after the first). It reports the measured throughput of
the chosen plan against the best measured one (goal >= 0.95), and how well the predicted order matches.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_plan_quality.py [--budget 24MiB] [--steps 6] [--calibrate]

`--calibrate` fits the cost model's per-term multipliers to the measured times (cost.calibrate) and prints
them: the way to re-derive the CPU constants in src/memtrain/planner/cost.py on another machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from memtrain.causal_lm.trainer import CausalLMTrainer  # noqa: E402
from memtrain.distributed import DistEnv  # noqa: E402
from memtrain.memory.headroom import measured_target  # noqa: E402
from memtrain.planner.cost import CostModel, calibrate  # noqa: E402
from memtrain.planner.model_probe import ModelProbe  # noqa: E402
from memtrain.planner.result import Scored  # noqa: E402
from memtrain.planner.search import search  # noqa: E402
from memtrain.recipe import Recipe, recipe_from_dict  # noqa: E402

MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
}


def recipe(budget: str | None, steps: int, out: Path, pinned: Scored | None = None) -> Recipe:
    strategies: dict[str, Any] = {
        "precision": "fp32",
        "checkpointing": "auto",
        "optimizer_states": "auto",
        "sharding": "none",
    }
    batch: dict[str, Any] = {"global_size": 16, "micro_size": "auto"}
    if pinned is not None:
        c = pinned.plan
        strategies.update(
            checkpointing=c.checkpointing.name,
            optimizer_states=c.optimizer_states.name,
            checkpointing_fraction=getattr(c.checkpointing, "fraction", 0.5),
        )
        batch["micro_size"] = c.micro_batch_size
    return recipe_from_dict(
        {
            "run": {"name": "plan-quality", "output_dir": str(out), "seed": 0},
            "model": {"config": MODEL},
            "data": {"source": "synthetic", "seq_len": 128, "synthetic": {"num_samples": 512}},
            "batch": batch,
            "train": {"steps": steps, "warmup_steps": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "memory": {"budget": budget} if budget is not None else {},
            "strategies": strategies,
        }
    )


def step_seconds(r: Recipe) -> float:
    """Median step time after the first step (no tracker: the budget was checked by the planner, and
    tests/planner/test_fit.py checks that the chosen plans really fit under it)."""
    CausalLMTrainer(r).fit()
    rows = [json.loads(line) for line in (r.output_path() / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["step_time_s"] for row in rows[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="24MiB", help="simulated device budget (default 24MiB)")
    parser.add_argument(
        "--steps", type=int, default=8, help="steps per plan and round (the first is not timed)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds over all plans; a plan's time is its best "
        "round (this machine is shared: the minimum is the least disturbed)",
    )
    parser.add_argument("--top", type=int, default=10, help="plans to measure (best predicted first)")
    parser.add_argument("--calibrate", action="store_true", help="fit and print the cost model's multipliers")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        base = recipe(args.budget, args.steps, Path(tmp) / "plan")
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
        target = measured_target(env, int(base.memory.budget or 0), base.planner.safety_fraction)
        result = search(base, ModelProbe(CausalLMTrainer(base).model_spec()), target, env.device)
        plans = list(result.ranked[: args.top])
        print(
            f"budget {args.budget}: {len(result.ranked)} plans fit, {len(result.infeasible)} do not; "
            f"measuring the {len(plans)} predicted fastest"
        )
        started = time.perf_counter()
        rounds = [
            [
                step_seconds(recipe(None, args.steps, Path(tmp) / f"run{r}-{i}", scored))
                for i, scored in enumerate(plans)
            ]
            for r in range(args.rounds)
        ]
        measured = [min(times) for times in zip(*rounds, strict=True)]
        print("| rank | plan | predicted peak | predicted s | measured s |")
        print("|---:|---|---:|---:|---:|")
        for index, (scored, seconds) in enumerate(zip(plans, measured, strict=True), 1):
            label = scored.plan.describe()
            print(
                f"| {index} | {label} | {scored.prediction.peak:,} | {scored.cost.total:.4f} | {seconds:.4f} |"
            )
    best = min(measured)
    print(
        f"\nchosen / best measured throughput: {best / measured[0]:.3f} (goal >= 0.95); "
        f"best is predicted rank {measured.index(best) + 1}; {time.perf_counter() - started:.0f} s of training"
    )
    if args.calibrate:
        model = calibrate(
            CostModel.for_device("cpu"), [(s.cost, t) for s, t in zip(plans, measured, strict=True)]
        )
        print(
            f"calibrated per-term multipliers (compute, recompute, micro-steps, optimizer, communication, "
            f"offload): {tuple(round(x, 3) for x in model.scale)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
