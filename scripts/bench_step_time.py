"""Step time: predicted (uncalibrated, and calibrated on *other* models) against measured, on this machine.

For a few tiny llama and gpt2 configs, the planner predicts the step time of several plans (checkpointing
none/full, micro-batches of 16 and 4 rows with accumulation, optimizer states fp32/bf16, plus the plan it
chooses); each is trained for `--steps` steps and its median step time after the first measured, in CPU
seconds of this one-thread process (the best of `--rounds` rounds). CPU seconds because this machine is
shared: its wall clock counts the other processes' turns too (the table shows both). Then, per config:

- uncalibrated: the device class's constants (`cost.SPEEDS`);
- held out: multipliers fitted (`step_time_calibration.fit`) to every measured plan of the *other* configs
  (what the cache falls back to for a model it cannot probe);
- probe: fitted to this model's timed probe (step_time_probe.py), what a new model's first plan starts with;
- probe + first run: the probe rescaled by the measured step of the plan chosen with it (what the trainer's
  first steps teach the cache), evaluated on every plan: what the model's next plan predicts;

and the plan the planner chooses with the probe, with its error. Last, the trainer's own path on
the first config with an empty cache, in wall-clock seconds as `memtrain train` measures: run 1 probes,
measures and re-fits when more than 10% off; run 2 starts from what run 1 cached (`step_time` of plan.json).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_step_time.py [--steps 6] [--rounds 2] \\
        [--json results/bench_step_time.json]

Goal (issue 16): the chosen plan's predicted step time within 10% of the measured one after calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from bench_plan_quality import MODEL as PLAN_QUALITY_MODEL  # noqa: E402

from memtrain.causal_lm.recipe import CausalLMRecipe  # noqa: E402
from memtrain.causal_lm.trainer import CausalLMTrainer  # noqa: E402
from memtrain.distributed import DistEnv  # noqa: E402
from memtrain.memory.headroom import measured_target  # noqa: E402
from memtrain.planner import step_time_calibration as stc  # noqa: E402
from memtrain.planner import step_time_probe  # noqa: E402
from memtrain.planner.cost import CostModel, StepCost  # noqa: E402
from memtrain.planner.model_probe import ModelProbe  # noqa: E402
from memtrain.planner.result import PlanResult, Scored  # noqa: E402
from memtrain.planner.search import search  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-h128-l4": PLAN_QUALITY_MODEL,  # the plan-quality benchmark's model
    "llama-h256-l2": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 4096,
        "max_position_embeddings": 256,
    },
    "gpt2-h128-l4": {
        "model_type": "gpt2",
        "n_embd": 128,
        "n_layer": 4,
        "n_head": 4,
        "vocab_size": 2048,
        "n_positions": 256,
    },
}
CHECKPOINTING = ("none", "full")
MICRO_ROWS = (16, 4)
STATES = ("fp32", "bf16")
GLOBAL_ROWS, SEQ_LEN = 16, 128
CPU = torch.device("cpu")


def recipe(config: dict[str, Any], out: Path, steps: int) -> CausalLMRecipe:
    return CausalLMRecipe.from_dict(
        {
            "run": {"name": "step-time", "output_dir": str(out), "seed": 0},
            "model": {"config": config},
            "data": {"source": "synthetic", "seq_len": SEQ_LEN, "synthetic": {"num_samples": 512}},
            "batch": {"global_size": GLOBAL_ROWS, "micro_size": "auto"},
            "train": {"steps": steps, "warmup_steps": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "strategies": {
                "precision": "fp32",
                "checkpointing": "auto",
                "optimizer_states": "auto",
                "sharding": "none",
            },
        }
    )


def plan_search(r: CausalLMRecipe, cost: CostModel) -> PlanResult:
    """The planner's search for this CPU (host memory as the budget), ranked with `cost`."""
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU)
    target = measured_target(env, None, r.planner.safety_fraction)
    return search(
        r, ModelProbe(CausalLMTrainer(r).model_spec(), progress=lambda _: None), target, CPU, cost=cost
    )


def benchmarked(result: PlanResult) -> list[Scored]:
    """The grid's plans this benchmark measures (uncalibrated predictions)."""
    wanted = {(c, m, s) for c in CHECKPOINTING for m in MICRO_ROWS for s in STATES}
    found = {}
    for scored in (*result.ranked, *result.infeasible):
        p = scored.plan
        key = (p.checkpointing.name, p.micro_batch_size, p.optimizer_states.name)
        if key in wanted and p.loss.name == "standard" and key not in found:
            found[key] = scored
    return [found[k] for k in sorted(found)]


class TimedTrainer(CausalLMTrainer):
    """Also times each step in CPU seconds of this process: on a shared machine the wall clock counts the
    other processes' turns too, and the CPU time of a one-thread run is what its plan costs."""

    def train_step(self, step: int) -> dict[str, Any]:
        started = time.process_time()
        row = super().train_step(step)
        row["cpu_time_s"] = time.process_time() - started
        self.rows.append(row)
        return row

    rows: list[dict[str, Any]]


def measure(r: CausalLMRecipe, scored: Scored, out: Path) -> tuple[float, float]:
    """Median (CPU, wall) seconds of the steps after the first of `scored`'s plan, trained as it is."""
    r = r.model_copy(update={"run": r.run.model_copy(update={"output_dir": str(out)})})
    trainer = TimedTrainer(r)
    trainer.rows = []
    trainer.plan = scored.plan
    trainer.plan_result = PlanResult(plan=scored.plan)  # nothing predicted: the run compares no step time
    trainer.sharding = scored.plan.sharding_backend(r.train.grad_clip)
    trainer.fit()
    trainer.close()
    timed = trainer.rows[1:]
    return (
        statistics.median(row["cpu_time_s"] for row in timed),
        statistics.median(row["step_time_s"] for row in timed),
    )


def predicted(cost: StepCost, model: CostModel) -> float:
    return sum(t * k for t, k in zip(cost.uncalibrated().terms(), model.scale, strict=True))


def measure_configs(steps: int, rounds: int, tmp: Path) -> dict[str, dict[str, Any]]:
    """Each config's measured plans: {"recipe", "plans": [(Scored, seconds)]}."""
    base = CostModel.for_device("cpu")
    measured: dict[str, dict[str, Any]] = {}
    for name, config in CONFIGS.items():
        r = recipe(config, tmp / name / "plan", steps)
        result = plan_search(r, base)
        plans = benchmarked(result)
        assert result.chosen is not None
        if all(s.plan != result.chosen.plan for s in plans):
            plans.append(result.chosen)
        started = time.perf_counter()
        times = [
            min(measure(r, s, tmp / name / f"{i}-{k}") for k in range(rounds)) for i, s in enumerate(plans)
        ]
        print(f"{name}: {len(plans)} plans measured in {time.perf_counter() - started:.0f} s", flush=True)
        measured[name] = {
            "recipe": r,
            "result": result,
            "plans": [(s, cpu) for s, (cpu, _) in zip(plans, times, strict=True)],
            "wall": [wall for _, wall in times],
        }
    return measured


def probe_timings(r: CausalLMRecipe) -> tuple[str, list[stc.Sample]]:
    """The planner's timed probe of `r`'s model (step_time_probe.py), in CPU seconds like the steps."""
    step_time_probe.CLOCK = time.process_time
    probe = ModelProbe(CausalLMTrainer(r).model_spec())
    measured = step_time_probe.time_model(probe, CPU, 2**50)
    name = step_time_probe.fingerprint(probe)
    return name, [stc.Sample(what, c.terms(), t, name) for what, c, t in measured]


def evaluate(measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per config and plan, against measured: the device class's constants; multipliers fitted to the
    other configs' runs (held out); fitted to this model's probe (a new model's first plan); and the probe
    rescaled by the first run's step (the chosen plan's, as `memtrain train` measures it: what the
    model's second run predicts for every plan). The planner's choice with the probe."""
    base = CostModel.for_device("cpu")
    report: dict[str, Any] = {"configs": {}}
    for name, entry in measured.items():
        others = [
            stc.Sample(s.plan.describe(), s.cost.uncalibrated().terms(), t)
            for o, e in measured.items()
            if o != name
            for s, t in e["plans"]
        ]
        model, timings = probe_timings(entry["recipe"])
        probed = stc.for_model(base, model, timings, [])
        chosen = plan_search(entry["recipe"], probed).chosen
        assert chosen is not None
        first_run = [
            stc.Sample("first run", s.cost.uncalibrated().terms(), t, model)
            for s, t in entry["plans"]
            if s.plan == chosen.plan
        ]
        models = {
            "uncalibrated_s": base,
            "held_out_s": stc.fit(base, others),
            "probe_s": probed,
            "probe_first_run_s": stc.for_model(base, model, timings, first_run),
        }
        rows = [
            {
                "plan": scored.plan.describe(),
                "measured_s": seconds,
                "measured_wall_s": wall,
                **{key: predicted(scored.cost, m) for key, m in models.items()},
            }
            for (scored, seconds), wall in zip(entry["plans"], entry["wall"], strict=True)
        ]
        report["configs"][name] = {
            "scales": {key: list(m.scale) for key, m in models.items()},
            "probe": [t.to_dict() for t in timings],
            "plans": rows,
            "chosen_calibrated": chosen.plan.describe(),
            "chosen_row": next((row for row in rows if row["plan"] == chosen.plan.describe()), None),
        }
    return report


def trainer_runs(config: dict[str, Any], steps: int, tmp: Path) -> list[dict[str, Any]]:
    """The planner's plan trained twice with an empty cache: the second run starts calibrated."""
    os.environ["MEMTRAIN_CACHE_DIR"] = str(tmp / "cache")
    step_time_probe.CLOCK = time.perf_counter  # the trainer's own path: wall clock throughout
    records = []
    for index in range(2):
        trainer = CausalLMTrainer(recipe(config, tmp / f"trainer{index}", steps))
        trainer.fit()
        assert trainer.monitor.step_time is not None
        records.append({"plan": trainer.plan.describe(), **trainer.monitor.step_time})
        trainer.close()
    return records


def error(p: float, m: float) -> str:
    return f"{(p - m) / m:+.1%}"


COLUMNS = {
    "uncalibrated_s": "uncalibrated",
    "held_out_s": "held out (other configs' runs)",
    "probe_s": "probe",
    "probe_first_run_s": "probe + first run",
}


def table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| config | plan | measured CPU s (wall) | "
        + " | ".join(f"{c} s (err)" for c in COLUMNS.values())
        + " |",
        "|---|---|---:|" + "---:|" * len(COLUMNS),
    ]
    for name, entry in report["configs"].items():
        for row in entry["plans"]:
            m = row["measured_s"]
            mark = " **chosen**" if row["plan"] == entry["chosen_calibrated"] else ""
            cells = " | ".join(f"{row[k]:.4f} ({error(row[k], m)})" for k in COLUMNS)
            lines.append(
                f"| {name} | {row['plan']}{mark} | {m:.4f} ({row['measured_wall_s']:.4f}) | {cells} |"
            )
    return lines


def summary(report: dict[str, Any]) -> list[str]:
    out = []
    for key, label in COLUMNS.items():
        errors = [
            abs(r[key] - r["measured_s"]) / r["measured_s"]
            for e in report["configs"].values()
            for r in e["plans"]
        ]
        chosen = [
            abs(e["chosen_row"][key] - e["chosen_row"]["measured_s"]) / e["chosen_row"]["measured_s"]
            for e in report["configs"].values()
            if e["chosen_row"] is not None
        ]
        out.append(
            f"{label}: all plans mean |err| {statistics.mean(errors):.1%}, max {max(errors):.1%}; "
            f"chosen plans max |err| {max(chosen):.1%}"
        )
    for record in report["trainer_runs"]:
        out.append(
            f"trainer run (wall clock): predicted {record['predicted_s']:.4f} s"
            f"{' (calibrated)' if record['calibrated'] else ''}, measured {record['measured_s']:.4f} s "
            f"({record['relative_error']:+.1%}), re-fit {record['refit']}"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per plan (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per plan; the fastest counts")
    parser.add_argument("--json", type=Path, default=REPO / "results/bench_step_time.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure_configs(args.steps, args.rounds, Path(tmp))
        report = evaluate(measured)
        report["trainer_runs"] = trainer_runs(CONFIGS["llama-h128-l4"], args.steps + 2, Path(tmp))
    report["machine"] = {"threads": torch.get_num_threads(), "steps": args.steps, "rounds": args.rounds}
    print("\n".join(["", *table(report), "", *summary(report)]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
