"""How right is memtrain's predicted peak, next to the estimators users reach for today, against the peak
actually measured — for one model under many plans (precision x optimizer states x checkpointing).

Why: memtrain picks plans by their predicted peak, so the prediction is the product; a prediction is only
worth trusting once it is shown beside the measured peak and beside what the alternatives would have said.
Side by side, per plan:

- memtrain's planner (`memtrain.planner.plan_for_run` on a recipe that allows only this plan: its trace of
  the real step composed over time), when this checkout has a planner (checked at run time);
- the sum of memtrain's per-strategy estimates (`Precision.estimate`, `OptimizerStates.estimate`) plus
  `Checkpointing.estimate` over an activation profile traced from one real micro-batch
  (`memtrain.memory.activation_profile`): what a prediction is without composing the components over time;
- the logic behind `accelerate estimate-memory` (accelerate/commands/estimate.py: the model built on the
  meta device with `init_empty_weights`, `calculate_maximum_sizes`, `estimate_training_usage`, whose
  largest entry the command prints as "Training using Adam"), run offline on the same config;
- DeepSpeed's `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs` for one
  GPU without offload (parameter counts taken from the meta model: DeepSpeed's own `model_to_params` keys
  parameters by `data_ptr`, which is 0 for every meta tensor).

Measured: on CPU the memtrain tracker's peak (every live tensor byte; max over the tracked steps); on CUDA
the allocator's `max_memory_allocated` (reset every step, max over steps) and `max_memory_reserved`.
Relative error = (estimate - measured) / measured; positive over-predicts. Goal on GPU: within 5% of
allocated. Plans that cannot run here (fp8 without CUDA, bitsandbytes missing, ...) are listed with the
reason instead of a row.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/estimator_accuracy.py [--json results/accuracy.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import logging
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer, build_config
from memtrain.distributed import init_distributed
from memtrain.errors import MemtrainError, Unsupported
from memtrain.memory.activation_profile import profile_activations
from memtrain.memory.footprint import ActivationProfile, Footprint
from memtrain.strategies.apply import apply_strategies
from memtrain.strategies.blocks import discover_blocks, model_shape
from memtrain.strategies.checkpointing import CHECKPOINTING, NoCheckpointing
from memtrain.strategies.optimizer import OPTIMIZER_STATES
from memtrain.strategies.precision import PRECISION

MODELS: dict[str, dict[str, Any]] = {
    # The Llama-like model of scripts/bench_strategies.py: 12 x 256, vocab 8192, 12M parameters (CPU).
    "llama-12m": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "vocab_size": 8192,
        "max_position_embeddings": 4096,
    },
    # ~134M parameters (GPU): large enough that kernel workspaces are a small share of the peak.
    "llama-134m": {
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    # The smoke test's model (tests/test_benchmark_scripts.py).
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 512,
    },
}

# (precision, checkpointing, checkpointing fraction, optimizer states); sharding is none throughout.
PLANS: tuple[tuple[str, str, float, str], ...] = (
    ("fp32", "none", 1.0, "fp32"),
    ("fp32", "full", 1.0, "fp32"),
    ("fp32", "selective", 1.0, "fp32"),
    ("fp32", "fraction", 0.5, "fp32"),
    ("fp32", "none", 1.0, "bf16"),
    ("fp32", "none", 1.0, "8bit"),
    ("bf16-mixed", "none", 1.0, "fp32"),
    ("bf16-mixed", "full", 1.0, "bf16"),
    ("bf16-master", "none", 1.0, "fp32"),
    ("bf16-master", "selective", 1.0, "8bit"),
    ("bf16-mixed", "offload", 1.0, "fp32"),  # on a CPU offload keeps activations where they are: CUDA only
    ("fp8", "none", 1.0, "fp32"),
    ("bf16-mixed", "full", 1.0, "paged-8bit"),
)


@dataclass(frozen=True)
class Settings:
    model: str
    seq_len: int
    global_batch: int
    micro_batch: int
    steps: int


def plan_label(plan: tuple[str, str, float, str]) -> str:
    precision, checkpointing, fraction, states = plan
    mode = f"fraction {fraction:g}" if checkpointing == "fraction" else checkpointing
    return f"{precision} / ckpt {mode} / states {states}"


def recipe_for(
    settings: Settings,
    plan: tuple[str, str, float, str],
    out: Path,
    *,
    track: bool,
    open_choices: bool = False,
) -> CausalLMRecipe:
    """The recipe of one plan. `open_choices`: each choice as a one-entry list, which sends the recipe
    through the planner (a recipe that pins everything skips it) with exactly this plan to predict."""
    precision, checkpointing, fraction, states = plan

    def choice(value: str) -> str | list[str]:
        return [value] if open_choices else value

    planner = {"checkpointing_fractions": [fraction]} if open_choices else {}
    return CausalLMRecipe.from_dict(
        {
            "run": {"name": "accuracy", "output_dir": str(out), "seed": 0},
            "model": {"config": MODELS[settings.model]},
            "data": {"source": "synthetic", "seq_len": settings.seq_len, "synthetic": {"num_samples": 64}},
            "batch": {"global_size": settings.global_batch, "micro_size": settings.micro_batch},
            "train": {"steps": settings.steps, "lr": 1e-4, "eval_every": 0},
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "memory": {"track": track},
            "strategies": {
                "precision": choice(precision),
                "checkpointing": choice(checkpointing),
                "checkpointing_fraction": fraction,
                "optimizer_states": choice(states),
                "sharding": "none",
            },
            "planner": planner,
        }
    )


# ------------------------------------------------------------------------------------------ measured


@dataclass
class Measured:
    peak: int  # CPU: tracker peak; CUDA: max_memory_allocated
    reserved: int | None = None  # CUDA only
    components: dict[str, int] = field(default_factory=dict)  # the tracker's breakdown at the peak (CPU)


def measure(settings: Settings, plan: tuple[str, str, float, str]) -> Measured:
    """Train `settings.steps` steps of the pinned plan; CPU under the tracker, CUDA untracked."""
    cuda = torch.cuda.is_available()
    _release()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = CausalLMTrainer(recipe_for(settings, plan, Path(tmp), track=not cuda))
        trainer.fit()
        if cuda:
            result = Measured(
                peak=trainer.monitor.max_step_peak, reserved=int(torch.cuda.max_memory_reserved())
            )
        else:
            top = max(trainer.monitor.memory_reports, key=lambda r: r.peak_bytes)
            result = Measured(peak=top.peak_bytes, components=dict(top.at_peak))
        del trainer
    _release()
    return result


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ memtrain


def planner_prediction(
    settings: Settings, plan: tuple[str, str, float, str]
) -> tuple[dict[str, int] | None, str]:
    """The planner's predicted peak and breakdown for exactly this plan, or None and why not (this checkout
    has no planner entry point `memtrain.planner.plan_for_run`, or it planned something else)."""
    try:
        planner = importlib.import_module("memtrain.planner")
    except ImportError:
        return None, "no memtrain.planner in this checkout"
    plan_for_run = getattr(planner, "plan_for_run", None)
    if plan_for_run is None:
        return None, "memtrain.planner has no plan_for_run"
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_for(settings, plan, Path(tmp), track=False, open_choices=True)
        # Unlimited headroom: the prediction, not the fit, is wanted (a plan over budget would raise).
        spec = CausalLMTrainer(recipe).model_spec()
    result = plan_for_run(recipe, init_distributed(), spec, free_bytes=2**60, progress=lambda _line: None)
    p = result.plan
    chosen = (
        p.precision.name,
        p.checkpointing.name,
        getattr(p.checkpointing, "fraction", 1.0),
        p.optimizer_states.name,
    )
    if result.chosen is None or chosen != plan:
        return None, f"the planner planned {plan_label(chosen)} instead"
    return result.chosen.prediction.at_peak.to_dict(), ""


def strategies_sum(
    settings: Settings, plan: tuple[str, str, float, str], profiles: dict[str, ActivationProfile]
) -> dict[str, int]:
    """Weights, gradients and optimizer states by the strategies' own arithmetic, plus the checkpointing
    estimate over a traced activation profile (one real micro-batch, no checkpointing), summed."""
    precision, checkpointing, fraction, states = plan
    with tempfile.TemporaryDirectory() as tmp:
        recipe = recipe_for(settings, plan, Path(tmp), track=False)
    config = build_config(recipe)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shape = model_shape(meta, discover_blocks(meta))
    footprint = PRECISION.create(precision).estimate(shape, Footprint())
    footprint = OPTIMIZER_STATES.create(states).estimate(
        shape, footprint
    )  # bf16-master: states of fp32 masters
    if precision not in profiles:
        profiles[precision] = activation_profile(recipe, precision, settings)
    if checkpointing == "offload" and not torch.cuda.is_available():
        checkpointing = (
            "none"  # host and device are one memory: offload keeps every byte (Checkpointing.estimate)
        )
    mode = CHECKPOINTING.create(checkpointing, {"checkpointing_fraction": fraction})
    footprint = mode.estimate(profiles[precision], footprint)
    return footprint.to_dict()


def activation_profile(recipe: CausalLMRecipe, precision: str, settings: Settings) -> ActivationProfile:
    """One micro-batch of the real model, built and run as the trainer would under this precision."""
    from transformers import AutoModelForCausalLM

    env = init_distributed()
    strategy = PRECISION.create(precision, {"fp8_emulate": recipe.strategies.fp8_emulate})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config(recipe))
    blocks = discover_blocks(model)
    apply_strategies(model, blocks, strategy, NoCheckpointing())
    model = model.to(env.device)
    vocab = int(MODELS[settings.model]["vocab_size"])
    ids = torch.randint(0, vocab, (settings.micro_batch, settings.seq_len + 1), device=env.device)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    job = SimpleNamespace(model_config=model.config)  # what the trainer's loss reads of itself

    def run_step() -> torch.Tensor:
        with strategy.autocast(env.device):
            return CausalLMTrainer.loss(job, model, batch)[0]  # type: ignore[arg-type]

    return profile_activations(model, blocks, run_step)


# ------------------------------------------------------------------------------------------ the peers


@dataclass(frozen=True)
class PeerEstimates:
    accelerate_fp32: int | None
    accelerate_mixed: int | None
    deepspeed_zero2: int | None
    deepspeed_zero3: int | None
    notes: tuple[str, ...]

    def accelerate(self, precision: str) -> int | None:
        return self.accelerate_fp32 if precision == "fp32" else self.accelerate_mixed


def peer_estimates(settings: Settings) -> PeerEstimates:
    notes: list[str] = []
    config = build_config(recipe_for(settings, PLANS[0], Path(tempfile.gettempdir()), track=False))
    fp32 = mixed = zero2 = zero3 = None
    try:
        from accelerate import init_empty_weights
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
        from transformers import AutoModelForCausalLM

        with init_empty_weights():  # what `accelerate estimate-memory` builds, from a local config
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        total_size, _largest = calculate_maximum_sizes(model)
        # The command prints the largest entry of the training estimate as "Training using Adam".
        fp32 = max(estimate_training_usage(total_size, "float32").values())
        mixed = max(estimate_training_usage(total_size, "bfloat16").values())
    except ImportError as exc:
        notes.append(f"accelerate's estimator unavailable: {exc}")
    try:
        with _quiet_output():
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        total, largest = parameter_counts(config)
        zero2 = int(estimate_zero2_model_states_mem_needs(total, 1, 1, cpu_offload=False)[1])
        zero3 = int(
            estimate_zero3_model_states_mem_needs(
                total, largest, 1, 1, cpu_offload=False, cpu_offload_params=False, zero_init=True
            )[1]
        )
    except ImportError as exc:
        notes.append(f"DeepSpeed's estimators unavailable: {exc}")
    return PeerEstimates(fp32, mixed, zero2, zero3, tuple(notes))


def parameter_counts(config: Any) -> tuple[int, int]:
    """DeepSpeed's `model_to_params` (stage3.py): distinct parameters, and the most any one module holds
    directly; counted on the meta device by identity."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: nn.Module = AutoModelForCausalLM.from_config(config)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


@contextlib.contextmanager
def _quiet_output() -> Iterator[None]:
    """DeepSpeed prints its accelerator detection on import."""
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


# ------------------------------------------------------------------------------------------ report


@dataclass
class Row:
    plan: str
    measured: Measured
    planner: dict[str, int] | None
    strategies: dict[str, int]
    accelerate: int | None
    deepspeed_zero2: int | None
    deepspeed_zero3: int | None
    seconds: float


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def err(estimate: int | None, measured: int | None) -> str:
    return "n/a" if estimate is None or not measured else f"{(estimate - measured) / measured:+.2%}"


def table(rows: list[Row], cuda: bool) -> list[str]:
    measured = "allocated" if cuda else "tracker"
    header = f"| plan | measured MiB ({measured}) |"
    rule = "|---|---|"
    if cuda:
        header += " measured MiB (reserved) |"
        rule += "---|"
    header += " memtrain planner MiB | err |"
    rule += "---|---|"
    if cuda:
        header += " err vs reserved |"
        rule += "---|"
    header += (
        " strategies' sum MiB | err | accelerate estimate-memory MiB | err | DeepSpeed ZeRO-2 MiB | err |"
        " DeepSpeed ZeRO-3 MiB | err |"
    )
    rule += "---|---|---|---|---|---|---|---|"
    lines = [header, rule]
    for r in rows:
        peak = r.planner["peak"] if r.planner is not None else None
        line = f"| {r.plan} | {mib(r.measured.peak)} |"
        if cuda:
            line += f" {mib(r.measured.reserved)} |"
        line += f" {mib(peak)} | {err(peak, r.measured.peak)} |"
        if cuda:
            line += f" {err(peak, r.measured.reserved)} |"
        line += (
            f" {mib(r.strategies['peak'])} | {err(r.strategies['peak'], r.measured.peak)} |"
            f" {mib(r.accelerate)} | {err(r.accelerate, r.measured.peak)} |"
            f" {mib(r.deepspeed_zero2)} | {err(r.deepspeed_zero2, r.measured.peak)} |"
            f" {mib(r.deepspeed_zero3)} | {err(r.deepspeed_zero3, r.measured.peak)} |"
        )
        lines.append(line)
    return lines


def summary(rows: list[Row]) -> list[str]:
    """Mean and worst absolute error of each estimator over the plans."""

    def stats(name: str, pairs: list[tuple[int | None, int]]) -> str:
        errors = [abs(e - m) / m for e, m in pairs if e is not None and m]
        if not errors:
            return f"- {name}: n/a"
        within = sum(e <= 0.05 for e in errors)
        return (
            f"- {name}: mean |error| {sum(errors) / len(errors):.2%}, worst {max(errors):.2%}, "
            f"{within} of {len(errors)} plans within 5%"
        )

    return [
        stats(
            "memtrain planner", [(r.planner["peak"] if r.planner else None, r.measured.peak) for r in rows]
        ),
        stats("strategies' sum", [(r.strategies["peak"], r.measured.peak) for r in rows]),
        stats("accelerate estimate-memory", [(r.accelerate, r.measured.peak) for r in rows]),
        stats("DeepSpeed ZeRO-2 model states", [(r.deepspeed_zero2, r.measured.peak) for r in rows]),
        stats("DeepSpeed ZeRO-3 model states", [(r.deepspeed_zero3, r.measured.peak) for r in rows]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", choices=tuple(MODELS), default=None, help="default: llama-12m on CPU, llama-134m on CUDA"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="default: 256 on CPU, 2048 on CUDA")
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    parser.add_argument(
        "--micro", type=int, default=None, help="micro-batch (default: batch / 2 on CUDA, batch on CPU)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per plan (default 2 on CPU, 3 on CUDA)"
    )
    parser.add_argument(
        "--plans", type=int, default=len(PLANS), help=f"the first N of the {len(PLANS)} plans"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no further plan after this (the table keeps the plans done)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    settings = Settings(
        model=args.model or ("llama-134m" if cuda else "llama-12m"),
        seq_len=args.seq_len or (2048 if cuda else 256),
        global_batch=args.batch,
        micro_batch=args.micro or (max(args.batch // 2, 1) if cuda else args.batch),
        steps=args.steps or (3 if cuda else 2),
    )
    logging.getLogger("transformers").setLevel(logging.ERROR)
    started = time.perf_counter()
    peers = peer_estimates(settings)
    profiles: dict[str, ActivationProfile] = {}
    rows: list[Row] = []
    skipped: list[str] = []
    planner_used = False
    for plan in PLANS[: args.plans]:
        label = plan_label(plan)
        t0 = time.perf_counter()
        if args.time_budget is not None and t0 - started > args.time_budget:
            skipped.append(f"{label}: the time budget ({args.time_budget:g} s) ran out")
            continue
        try:
            measured = measure(settings, plan)
        except (Unsupported, MemtrainError) as exc:
            skipped.append(f"{label}: {exc}")
            print(f"skipped {label}: {exc}", flush=True)
            continue
        predicted, why_not = planner_prediction(settings, plan)
        planner_used = planner_used or predicted is not None
        if why_not:
            skipped.append(f"{label}: memtrain planner column n/a: {why_not}")
        row = Row(
            plan=label,
            measured=measured,
            planner=predicted,
            strategies=strategies_sum(settings, plan, profiles),
            accelerate=peers.accelerate(plan[0]),
            deepspeed_zero2=peers.deepspeed_zero2,
            deepspeed_zero3=peers.deepspeed_zero3,
            seconds=time.perf_counter() - t0,
        )
        rows.append(row)
        print(table([row], cuda)[-1], flush=True)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    lines = (
        table(rows, cuda)
        + [""]
        + summary(rows)
        + [""]
        + [
            f"- Model {settings.model}, {settings.global_batch} x {settings.seq_len} tokens per step in micro-batches "
            f"of {settings.micro_batch}, {settings.steps} steps per plan, on {device}, torch {torch.__version__}.",
            "- memtrain planner: "
            + (
                "`memtrain.planner.plan_for_run` on a recipe that allows only the row's plan."
                if planner_used
                else "not available in this checkout (column n/a)."
            ),
            "- strategies' sum: `Precision.estimate` + `OptimizerStates.estimate` + `Checkpointing.estimate` over "
            "an activation profile traced from one real micro-batch, added up (no composition over time).",
            '- accelerate: the "Training using Adam" figure of `accelerate estimate-memory` (float32 for fp32 '
            "plans, its mixed-precision figure otherwise): model states only, no activations, no plan knobs.",
            "- DeepSpeed: `estimate_zero{2,3}_model_states_mem_needs` GPU bytes for 1 GPU, no offload: model "
            "states of its fp16/bf16 mixed-precision engine, no activations.",
        ]
        + [f"- {n}" for n in peers.notes]
        + [f"- skipped {s}" for s in skipped]
        + [f"- Wall time: {time.perf_counter() - started:.0f} s."]
    )
    print("\n".join(lines))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(lines) + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "settings": asdict(settings),
                    "device": device,
                    "cuda": cuda,
                    "planner_used": planner_used,
                    "rows": [asdict(r) for r in rows],
                    "skipped": skipped,
                    "peer_notes": list(peers.notes),
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
