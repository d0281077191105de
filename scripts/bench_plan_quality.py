"""Plan quality: does the planner's choice train as fast as the best plan that fits?

At a fixed simulated budget (CPU), the planner ranks every allowed plan; this script trains the ten plans
it predicts fastest among those that fit (its choice first) for a few steps each, under that budget, and
measures their step time (median over the steps after the first). It reports the measured throughput of
the chosen plan against the best measured one (goal >= 0.95), and how well the predicted order matches.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_plan_quality.py [--budget 24MiB] [--steps 6] [--calibrate]

`--calibrate` fits the cost model's per-term multipliers to the measured times (cost.calibrate) and prints
them: the way to re-derive the CPU constants in src/memtrain/planner/cost.py on another machine.

`--oracle` is the full check (issues 16, 44): for each of `--oracle-models` (tiny configs of `MODELS`: a
Llama, a Qwen2 and a Qwen2-MoE) at each of `--oracle-budgets` (three by default; a budget is bytes, e.g.
`28MiB`, or a share of the model's own predicted peak with no budget, e.g. `60%`) it trains every plan the
planner considers feasible, not only the predicted top ten, for `--steps` steps *under* the
budget (`memory.budget`: the tracker raises a real OutOfMemoryError past it; an OOM is counted, not
recovered from, against that plan), then reports the chosen plan's measured throughput over the best
measured one, the chosen plan's rank among the measured plans, and how many predicted-feasible plans ran
out of memory (or passed the planner's usable share of the budget). Every plan runs with the tracker on,
so their step times carry the same per-operation overhead. An OOM memtrain would recover from is a
failure here (the trainer is handed the plan with no budget to re-plan against). About 3-4 s per plan at
the default 8 steps on an idle 2-core CPU; 20 and 40 MiB hold 5 and 51 predicted-feasible plans:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_plan_quality.py --oracle [--json results/oracle.json]
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_plan_quality.py --oracle --oracle-models llama,qwen2,qwen2_moe \
        --oracle-budgets 40%,60%,100% --json results/oracle_models.json      # issue 44's three models
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

from memtrain.causal_lm.recipe import CausalLMRecipe  # noqa: E402
from memtrain.causal_lm.trainer import CausalLMTrainer  # noqa: E402
from memtrain.distributed import DistEnv  # noqa: E402
from memtrain.memory.headroom import measured_target  # noqa: E402
from memtrain.planner.cost import CostModel, calibrate  # noqa: E402
from memtrain.planner.model_probe import ModelProbe  # noqa: E402
from memtrain.planner.result import PlanResult, Scored  # noqa: E402
from memtrain.planner.search import search  # noqa: E402
from memtrain.planner.step_time_calibration import local_cost_model  # noqa: E402

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
UNCONSTRAINED = "4GiB"  # a simulated budget far above any tiny model's fastest plan
MODELS: dict[str, dict[str, Any]] = {
    "llama": MODEL,
    "qwen2": {
        **MODEL,
        "model_type": "qwen2",
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 6,
    },
    "qwen2_moe": {  # 8 experts, 2 routed per token, a shared expert: routed load from the initial router
        **MODEL,
        "model_type": "qwen2_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "shared_expert_intermediate_size": 192,
        "decoder_sparse_step": 1,
    },
}


def recipe(
    budget: str | None, steps: int, out: Path, pinned: Scored | None = None, model: str = "llama"
) -> CausalLMRecipe:
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
    return CausalLMRecipe.from_dict(
        {
            "run": {"name": "plan-quality", "output_dir": str(out), "seed": 0},
            "model": {"config": MODELS[model]},
            "data": {"source": "synthetic", "seq_len": 128, "synthetic": {"num_samples": 512}},
            "batch": batch,
            "train": {"steps": steps, "warmup_steps": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "memory": {"budget": budget} if budget is not None else {},
            "strategies": strategies,
        }
    )


def step_seconds(r: CausalLMRecipe) -> float:
    """Median step time after the first step (no tracker: the budget was checked by the planner, and
    tests/planner/test_fit.py checks that the chosen plans really fit under it)."""
    CausalLMTrainer(r).fit()
    rows = [json.loads(line) for line in (r.output_path() / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["step_time_s"] for row in rows[1:])


def plan_search(
    budget: str, steps: int, out: Path, model: str = "llama"
) -> tuple[CausalLMRecipe, PlanResult]:
    """The planner's search at `budget`, as `memtrain train` would run it on this CPU."""
    base = recipe(budget, steps, out, model=model)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    target = measured_target(env, int(base.memory.budget or 0), base.planner.safety_fraction)
    probe = ModelProbe(CausalLMTrainer(base).model_spec())
    cost = local_cost_model(env.device, probe, target.budget.usable)  # calibrated, as a run plans here
    return base, search(base, probe, target, env.device, cost=cost)


def train_under_budget(base: CausalLMRecipe, scored: Scored, out: Path) -> dict[str, Any]:
    """Train one plan as it is (the trainer is handed the plan, every strategy and the micro-batch)
    under the recipe's `memory.budget`; an OOM is the plan's failure (memtrain would re-plan: not here)."""
    r = base.model_copy(update={"run": base.run.model_copy(update={"output_dir": str(out)})})
    trainer = CausalLMTrainer(r)
    trainer.plan = scored.plan
    trainer.plan_result = PlanResult(plan=scored.plan)  # no budget in it: the run does not re-plan
    trainer.sharding = scored.plan.sharding_backend(r.train.grad_clip)
    row: dict[str, Any] = {
        "plan": scored.plan.describe(),
        "predicted_peak": scored.prediction.peak,
        "predicted_s": scored.cost.total,
    }
    try:
        trainer.setup()
        trainer.fit()
        error = ""
    except Exception as exc:  # an OOM memtrain did not recover from, or a failure: the plan's row says which
        error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    reports = trainer.monitor.memory_reports
    row["measured_peak"] = max((m.peak_bytes for m in reports), default=None)
    if trainer.monitor.oom_events or "OutOfMemoryError" in error:
        row.update(status="out of memory", error=error)
    elif error:
        row.update(status="error", error=error)
    else:
        lines = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
        times = [json.loads(line)["step_time_s"] for line in lines][1:]
        row.update(status="ok", measured_s=statistics.median(times) if times else None)
    trainer.close()
    return row


def oracle(models: list[str], budgets: list[str], steps: int, max_plans: int | None) -> dict[str, Any]:
    """Every predicted-feasible plan of each model at each budget, trained under it; each one's summary."""
    report: dict[str, Any] = {"budgets": []}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for asked in budgets:
                budget = absolute_budget(asked, steps, Path(tmp) / "reference", model)
                base, result = plan_search(budget, steps, Path(tmp) / "plan", model)
                assert result.budget is not None
                plans = list(result.ranked[:max_plans] if max_plans else result.ranked)
                print(
                    f"{model}, budget {asked} ({budget}): {len(result.ranked)} plans predicted to fit "
                    f"({len(result.infeasible)} not); training {len(plans)} under the budget",
                    flush=True,
                )
                started = time.perf_counter()
                rows = []
                for index, scored in enumerate(plans):
                    row = train_under_budget(base, scored, Path(tmp) / f"{model}-{asked}-{index}")
                    rows.append({"predicted_rank": index + 1, **row})
                seconds = time.perf_counter() - started
                summary = summarise(asked, result.budget.usable, len(result.ranked), rows, seconds)
                report["budgets"].append({"model": model, **summary})
                print(oracle_line(report["budgets"][-1]), flush=True)
    return report


def absolute_budget(asked: str, steps: int, out: Path, model: str) -> str:
    """`asked` in bytes: a share (`60%`) of the peak the planner predicts for `model`'s fastest plan when
    memory is no constraint (`UNCONSTRAINED`), else `asked` as it is (`28MiB`)."""
    if not asked.endswith("%"):
        return asked
    _, unbounded = plan_search(UNCONSTRAINED, steps, out, model)
    peak = unbounded.ranked[0].prediction.peak
    return f"{int(peak * float(asked[:-1]) / 100)}B"


def summarise(
    budget: str, usable: int, feasible: int, rows: list[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    ran = sorted((r for r in rows if r["status"] == "ok" and r["measured_s"]), key=lambda r: r["measured_s"])
    chosen = rows[0] if rows else None
    summary: dict[str, Any] = {
        "budget": budget,
        "usable_bytes": usable,
        "predicted_feasible": feasible,
        "trained": len(rows),
        "out_of_memory": sum(r["status"] == "out of memory" for r in rows),
        "errors": sum(r["status"] == "error" for r in rows),
        "passed_usable": sum((r["measured_peak"] or 0) > usable for r in rows),
        "chosen": chosen["plan"] if chosen else None,
        "seconds": round(seconds, 1),
        "plans": rows,
    }
    if ran:
        summary.update(best=ran[0]["plan"], best_predicted_rank=ran[0]["predicted_rank"])
    if chosen is not None and chosen in ran:
        summary.update(
            chosen_over_best=ran[0]["measured_s"] / chosen["measured_s"],
            chosen_rank_measured=ran.index(chosen) + 1,
        )
    return summary


def oracle_line(s: dict[str, Any]) -> str:
    head = (
        f"{s['model']}, budget {s['budget']}: {s['trained']} of {s['predicted_feasible']} predicted-feasible plans trained "
        f"({s['seconds']:.0f} s); {s['out_of_memory']} ran out of memory, {s['errors']} failed otherwise, "
        f"{s['passed_usable']} passed the usable {s['usable_bytes']:,} bytes"
    )
    if "chosen_over_best" not in s:
        return head + f"; the chosen plan ({s['chosen']}) did not train"
    return (
        head + f"; chosen / best measured throughput {s['chosen_over_best']:.3f} (goal >= 0.97), chosen plan "
        f"rank {s['chosen_rank_measured']} of {sum(r['status'] == 'ok' for r in s['plans'])} measured; best: "
        f"{s['best']} (predicted rank {s['best_predicted_rank']})"
    )


def oracle_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| model | budget | predicted feasible | trained | ran out of memory | passed usable | chosen / best "
        "measured | chosen's measured rank | best plan (its predicted rank) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in report["budgets"]:
        ratio = f"{s['chosen_over_best']:.3f}" if "chosen_over_best" in s else "chosen did not train"
        rank = s.get("chosen_rank_measured", "n/a")
        best = f"{s['best']} ({s['best_predicted_rank']})" if "best" in s else "n/a"
        lines.append(
            f"| {s['model']} | {s['budget']} | {s['predicted_feasible']} | {s['trained']} | {s['out_of_memory']} | "
            f"{s['passed_usable']} | {ratio} | {rank} | {best} |"
        )
    return lines


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
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="train every predicted-feasible plan under each --oracle-budgets",
    )
    parser.add_argument(
        "--oracle-budgets",
        default="20MiB,28MiB,40MiB",
        help="comma-separated: bytes (28MiB) or a share of each model's unbudgeted predicted peak (60%%)",
    )
    parser.add_argument(
        "--oracle-models",
        default="llama",
        help=f"comma-separated, of {', '.join(MODELS)} (default llama)",
    )
    parser.add_argument(
        "--max-plans",
        type=int,
        default=None,
        help="--oracle: the first N predicted (a smoke run; default all)",
    )
    parser.add_argument("--json", type=Path, default=None, help="--oracle: write every plan's row here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.oracle:
        models = [m for m in args.oracle_models.split(",") if m]
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            parser.error(f"--oracle-models: {', '.join(unknown)} not among {', '.join(MODELS)}")
        budgets = [b for b in args.oracle_budgets.split(",") if b]
        report = oracle(models, budgets, args.steps, args.max_plans)
        print("\n".join(["", *oracle_table(report)]))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        _, result = plan_search(args.budget, args.steps, Path(tmp) / "plan")
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
