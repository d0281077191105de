"""memtrain side by side with what a user already runs: the same model, data and settings trained by
(a) a hand-written PyTorch loop, (b) HF `transformers.Trainer`, (c) an accelerate loop, (d) memtrain with
the same pinned plan and (e) memtrain with every choice left `auto`.

Why this exists: memtrain is worth adopting only if, at equal settings, its loop costs no time over the
loop a user would write and its memory is no worse than the framework they use now. Each peer is set up
the way its documentation recommends, with settings pinned to be equal where they would differ by
default (optimizer implementation, learning-rate schedule, sampling order):

- data: one list of synthetic global batches (memtrain's own synthetic pipeline, fixed length, no
  padding), split into the same micro-batches for everyone; every tool sees the same rows in the same order;
- model: one Llama-style config, built with the same seed (identical initial weights);
- settings: AdamW (torch's, default implementation) with the same lr, betas, eps and no weight decay, a
  constant learning rate, gradient clipping at 1.0, the same global batch and micro-batch (accumulation),
  fp32 on CPU (`--precision bf16-mixed` for autocast, the default on CUDA).

Each run is a fresh subprocess (no allocator, thread-pool or accelerate singleton state carried from one
tool to the next; its peak RSS is its own). Repetitions interleave the tools, alternating the order, so
drifts in machine load hit every tool alike. Step time is the time between consecutive optimizer-step
ends (CUDA synchronised), from step `warmup + 1` on; the ratio to (a) is the median over repetitions of
the per-repetition ratio. Memory: the memtrain tracker (every live tensor byte) wrapped around each
tool's loop in one more run per tool, the process's peak RSS above its RSS before the model was built,
and on CUDA the allocator's peaks (allocated and reserved).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_vs_peers.py [--quick] [--reps 5] [--json results/peers.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer, build_config
from memtrain.memory import MemoryTracker, StepMemory, process_peak_rss_bytes
from memtrain.memory.cheap import reset_peak_rss

Batch = dict[str, torch.Tensor]
RESULT = "peer-result: "  # prefix of a worker's JSON answer (HF Trainer prints dicts of its own)

TOOLS: dict[str, str] = {
    "hand": "(a) hand-written PyTorch loop",
    "hf": "(b) HF transformers.Trainer",
    "accelerate": "(c) accelerate loop",
    "memtrain": "(d) memtrain, same pinned plan",
    "memtrain-auto": "(e) memtrain, strategies auto",
}

MODELS: dict[str, dict[str, Any]] = {
    # ~58M parameters: the 50-100M class.
    "llama-58m": {
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 1024,
    },
    # ~17M parameters: --quick, so the whole comparison fits in a few minutes on a 2-core CPU.
    "llama-17m": {
        "model_type": "llama",
        "hidden_size": 384,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "vocab_size": 8192,
        "max_position_embeddings": 1024,
    },
    # ~0.1M parameters: the smoke test (tests/test_benchmark_scripts.py), seconds per run.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
    },
}


@dataclass(frozen=True)
class Setup:
    """Everything the tools share; it travels to each worker process as JSON."""

    model: str = "llama-58m"
    seq_len: int = 256
    global_batch: int = 8
    micro_batch: int = 4
    steps: int = 6  # per run; the first `warmup` step times are dropped
    warmup: int = 1
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "fp32"  # fp32 | bf16-mixed
    seed: int = 0

    @property
    def accumulation(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def recipe(self, out_dir: Path, *, auto: bool, track: bool, steps: int | None = None) -> CausalLMRecipe:
        """The memtrain recipe of these settings: the pinned plan, or every choice `auto`."""
        strategies: dict[str, Any] = (
            {"precision": "auto", "checkpointing": "auto", "optimizer_states": "auto", "sharding": "auto"}
            if auto
            else {
                "precision": self.precision,
                "checkpointing": "none",
                "optimizer_states": "fp32",
                "sharding": "none",
            }
        )
        return CausalLMRecipe.from_dict(
            {
                "run": {"name": "peers", "output_dir": str(out_dir), "seed": self.seed},
                "model": {"config": MODELS[self.model]},
                "data": {
                    "source": "synthetic",
                    "seq_len": self.seq_len,
                    "synthetic": {"num_samples": max(64, 2 * self.global_batch * self.steps)},
                },
                "batch": {
                    "global_size": self.global_batch,
                    "micro_size": "auto" if auto else self.micro_batch,
                },
                "train": {
                    "steps": steps or self.steps,
                    "lr": self.lr,
                    "betas": list(self.betas),
                    "eps": self.eps,
                    "weight_decay": 0.0,
                    "warmup_steps": 0,
                    "min_lr_ratio": 1.0,
                    "grad_clip": self.grad_clip,
                    "eval_every": 0,
                },
                "checkpoint": {"every": 0, "at_end": False},
                "output": {"progress": "off"},
                "memory": {"track": track},
                "strategies": strategies,
            }
        )


@dataclass
class RunResult:
    """What one worker measured for one tool."""

    tool: str
    plan: str
    step_seconds: list[float] = field(default_factory=list)
    step_cpu_seconds: list[float] = field(default_factory=list)  # process CPU time per step
    rss_above_start_bytes: int = 0
    cuda_peak_allocated_bytes: int | None = None
    cuda_peak_reserved_bytes: int | None = None
    tracker_peak_bytes: int | None = None
    tracker_at_peak: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ shared pieces


def device() -> torch.device:
    """memtrain trains on the CUDA device when there is one, so every tool does."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def step_batches(setup: Setup, steps: int) -> list[Batch]:
    """The global batches of `steps` steps, exactly as memtrain's CausalLMTrainer draws them."""
    recipe = setup.recipe(Path(tempfile.gettempdir()), auto=False, track=False, steps=steps)
    vocab = int(MODELS[setup.model]["vocab_size"])
    splits = data_lib.build_splits(recipe.data, vocab, recipe.run.seed)
    sampler = data_lib.StepSampler(len(splits.train), setup.global_batch, recipe.run.seed)
    batches = []
    for step in range(steps):
        ids = sampler.indices(step)
        batch = data_lib.collate([splits.train[i] for i in ids], ids)
        batches.append({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    return batches


def micro_batches(batch: Batch, micro: int) -> list[Batch]:
    return [
        {k: v[i : i + micro] for k, v in batch.items()} for i in range(0, batch["input_ids"].shape[0], micro)
    ]


def build_model(setup: Setup, model_config: dict[str, Any] | None = None) -> nn.Module:
    """The model every peer trains: the same config and seed as memtrain's own build."""
    from transformers import AutoModelForCausalLM

    recipe = setup.recipe(Path(tempfile.gettempdir()), auto=False, track=False)
    if model_config is not None:
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"config": model_config})})
    torch.manual_seed(setup.seed)
    return AutoModelForCausalLM.from_config(build_config(recipe), attn_implementation="sdpa")


def adamw(model: nn.Module, setup: Setup) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(), lr=setup.lr, betas=setup.betas, eps=setup.eps, weight_decay=0.0
    )


def mean_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """What a hand-written loop computes: the mean cross-entropy of the micro-batch."""
    logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1))


def autocast(setup: Setup) -> contextlib.AbstractContextManager[Any]:
    if setup.precision == "bf16-mixed":
        return torch.autocast(device_type=device().type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StepClock:
    """Records when each optimizer step ends (after a CUDA synchronise); step times are the gaps. Also the
    process's CPU time at each end: on a CPU shared with other jobs, wall time measures the neighbours as
    much as the loop, while the CPU time a single-threaded run spends per step does not."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def reset(self) -> None:
        self.ends.clear()
        self.cpu_ends.clear()

    def tick(self) -> None:
        if device().type == "cuda":
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())

    def step_seconds(self, warmup: int, cpu: bool = False) -> list[float]:
        ends = self.cpu_ends if cpu else self.ends
        gaps = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]  # gap i: step i + 2
        return gaps[max(warmup - 1, 0) :]


class Probe:
    """The step boundaries and phases of a loop, for the clock and (when tracking) the memory tracker."""

    def __init__(self, clock: StepClock, tracker: MemoryTracker | None = None) -> None:
        self.clock = clock
        self.tracker = tracker
        self.reports: list[StepMemory] = []

    def begin(self, step: int) -> None:
        if self.tracker is not None:
            self.tracker.begin_step(step)

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.tracker.phase(name) if self.tracker is not None else contextlib.nullcontext()

    def end(self) -> None:
        if self.tracker is not None:
            self.reports.append(self.tracker.end_step())
        self.clock.tick()


def tracking(
    model: nn.Module, optimizer: torch.optim.Optimizer, track: bool
) -> contextlib.AbstractContextManager[Any]:
    """The memtrain tracker around any loop (or nothing)."""
    return MemoryTracker(model, optimizer) if track else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------ the tools


def run_hand(
    setup: Setup, batches: list[Batch], probe_for: Callable[[MemoryTracker | None], Probe], track: bool
) -> str:
    """(a) What a user writes by hand: mean loss per micro-batch / accumulation steps, backward, clip, step."""
    model = build_model(setup).to(device())
    optimizer = adamw(model, setup)
    with tracking(model, optimizer, track) as tracker:
        probe = probe_for(tracker)
        for step, batch in enumerate(batches):
            probe.begin(step + 1)
            for micro in micro_batches(batch, setup.micro_batch):
                micro = {k: v.to(device()) for k, v in micro.items()}
                with probe.phase("forward"), autocast(setup):
                    loss = mean_loss(model, micro) / setup.accumulation
                with probe.phase("backward"):
                    loss.backward()
            with probe.phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss.item()
            del loss
            probe.end()
    return f"{setup.precision}, micro {setup.micro_batch} x {setup.accumulation}"


class RowsDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The global batches' rows in order, one row per item: what a DataLoader re-batches identically."""

    def __init__(self, batches: list[Batch], labels_are_inputs: bool) -> None:
        self.inputs = torch.cat([b["input_ids"] for b in batches])
        self.labels = self.inputs if labels_are_inputs else torch.cat([b["labels"] for b in batches])

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[index], "labels": self.labels[index]}


def write_report(lines: list[str], data: Any, markdown: Path | None, json_path: Path | None) -> None:
    """Print the report's markdown lines, and write them (`--markdown`) and `data` (`--json`) where asked."""
    print("\n".join(lines))
    if markdown:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text("\n".join(lines) + "\n")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=2))


QUIET_HF_ARGS: dict[str, Any] = {  # HF Trainer as the benchmarks run it: constant lr, no eval, saving or logs
    "weight_decay": 0.0,
    "lr_scheduler_type": "constant",
    "eval_strategy": "no",
    "save_strategy": "no",
    "report_to": [],
    "logging_strategy": "no",
    "disable_tqdm": True,
    "train_sampling_strategy": "sequential",
}


def hf_arguments(setup: Setup, out_dir: Path, steps: int, **overrides: Any) -> Any:
    """TrainingArguments as the Trainer docs recommend for a plain training run: no eval, no saving,
    no reporting; the optimizer, schedule and order pinned to the other tools' (HF's defaults are
    the fused AdamW, a linear decay and a random order)."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = {
        "output_dir": str(out_dir),
        "per_device_train_batch_size": setup.micro_batch,
        "gradient_accumulation_steps": setup.accumulation,
        "max_steps": steps,
        "learning_rate": setup.lr,
        "adam_beta1": setup.betas[0],
        "adam_beta2": setup.betas[1],
        "adam_epsilon": setup.eps,
        "max_grad_norm": setup.grad_clip,
        "optim": "adamw_torch",
        **QUIET_HF_ARGS,
        "use_cpu": device().type == "cpu",
        "bf16": setup.precision == "bf16-mixed",
        "dataloader_pin_memory": device().type == "cuda",
        "seed": setup.seed,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def hf_callback(probe_for: Callable[[MemoryTracker | None], Probe], track: bool) -> Any:
    """A TrainerCallback that starts the tracker once the Trainer has built its optimizer and marks steps."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.tracker: MemoryTracker | None = None
            self.probe: Probe | None = None

        def on_train_begin(
            self,
            args: Any,
            state: Any,
            control: Any,
            model: nn.Module | None = None,
            optimizer: Any = None,
            **kwargs: Any,
        ) -> None:
            if track:
                assert model is not None and optimizer is not None
                self.tracker = MemoryTracker(model, getattr(optimizer, "optimizer", optimizer))
                self.tracker.__enter__()
            self.probe = probe_for(self.tracker)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            assert self.probe is not None
            self.probe.begin(state.global_step + 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            assert self.probe is not None
            self.probe.end()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.tracker is not None:
                self.tracker.__exit__(None, None, None)

    return Steps()


def run_hf(
    setup: Setup, batches: list[Batch], probe_for: Callable[[MemoryTracker | None], Probe], track: bool
) -> str:
    """(b) HF Trainer. Labels are the inputs (the model shifts them), as the causal-LM docs do: the same
    forward size as the other tools, one target fewer per row."""
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(
            model=build_model(setup),
            args=hf_arguments(setup, Path(tmp), len(batches)),
            train_dataset=RowsDataset(batches, labels_are_inputs=True),
            callbacks=[hf_callback(probe_for, track)],
        )
        trainer.train()
    return f"{setup.precision}, micro {setup.micro_batch} x {setup.accumulation}"


def run_accelerate(
    setup: Setup, batches: list[Batch], probe_for: Callable[[MemoryTracker | None], Probe], track: bool
) -> str:
    """(c) The accelerate loop of its gradient-accumulation guide: `accumulate`, `backward`, `clip_grad_norm_`."""
    from accelerate import Accelerator

    accelerator = Accelerator(
        gradient_accumulation_steps=setup.accumulation,
        cpu=device().type == "cpu",
        mixed_precision="bf16" if setup.precision == "bf16-mixed" else "no",
    )
    model = build_model(setup)
    optimizer = adamw(model, setup)
    loader = torch.utils.data.DataLoader(
        RowsDataset(batches, labels_are_inputs=False), batch_size=setup.micro_batch, shuffle=False
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with tracking(accelerator.unwrap_model(model), optimizer.optimizer, track) as tracker:
        probe = probe_for(tracker)
        step = 0
        for index, micro in enumerate(loader):
            if index % setup.accumulation == 0:
                step += 1
                probe.begin(step)
            with accelerator.accumulate(model):
                with probe.phase("forward"):
                    loss = mean_loss(model, micro)
                with probe.phase("backward"):
                    accelerator.backward(loss)
                with probe.phase("optimizer"):
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), setup.grad_clip)
                    optimizer.step()
                    optimizer.zero_grad()
            if accelerator.sync_gradients:
                loss.item()
                del loss
                probe.end()
    accelerator.free_memory()
    return f"{setup.precision}, micro {setup.micro_batch} x {setup.accumulation}"


class TimedTrainer(CausalLMTrainer):
    """memtrain's causal-LM trainer, unchanged but for a call after each optimizer step (the clock)."""

    def __init__(self, recipe: CausalLMRecipe, on_step_end: Callable[[], None]) -> None:
        super().__init__(recipe)
        self.on_step_end = on_step_end

    def train_step(self, step: int) -> dict[str, Any]:
        row = super().train_step(step)
        self.on_step_end()
        return row


def run_memtrain(
    setup: Setup, probe_for: Callable[[MemoryTracker | None], Probe], track: bool, *, auto: bool, steps: int
) -> str:
    """(d)/(e) memtrain's own loop (`fit()`), its tracker switched on by `memory.track` when tracking."""
    clock_probe = probe_for(None)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TimedTrainer(setup.recipe(Path(tmp), auto=auto, track=track, steps=steps), clock_probe.end)
        trainer.fit()
        clock_probe.reports.extend(trainer.monitor.memory_reports)
        p = trainer.plan
    return p.describe()


# ------------------------------------------------------------------------------------------ one worker


def run_tool(tool: str, setup: Setup, track: bool) -> RunResult:
    """One run of `tool` in this process: time and peak RSS; or, with `track`, the tracker's peak."""
    steps = 2 if track else setup.steps
    batches = step_batches(setup, steps)
    clock = StepClock()
    probes: list[Probe] = []

    def probe_for(tracker: MemoryTracker | None) -> Probe:
        probes.append(Probe(clock, tracker))
        return probes[-1]

    gc.collect()
    reset_peak_rss()
    start_rss = process_peak_rss_bytes()  # right after a reset, the peak is the current RSS
    if device().type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if tool == "hand":
        plan = run_hand(setup, batches, probe_for, track)
    elif tool == "hf":
        plan = run_hf(setup, batches, probe_for, track)
    elif tool == "accelerate":
        plan = run_accelerate(setup, batches, probe_for, track)
    else:
        plan = run_memtrain(setup, probe_for, track, auto=tool == "memtrain-auto", steps=steps)
    result = RunResult(
        tool=tool,
        plan=plan,
        step_seconds=clock.step_seconds(setup.warmup),
        step_cpu_seconds=clock.step_seconds(setup.warmup, cpu=True),
        rss_above_start_bytes=process_peak_rss_bytes() - start_rss,
    )
    if device().type == "cuda":
        result.cuda_peak_allocated_bytes = int(torch.cuda.max_memory_allocated())
        result.cuda_peak_reserved_bytes = int(torch.cuda.max_memory_reserved())
    reports = [r for p in probes for r in p.reports]
    if track and reports:
        peak = max(reports, key=lambda r: r.peak_bytes)
        result.tracker_peak_bytes, result.tracker_at_peak = peak.peak_bytes, dict(peak.at_peak)
    return result


def spawn(tool: str, setup: Setup, track: bool) -> RunResult:
    """Run `tool` in a fresh Python process (this script with --worker) and read its JSON answer."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        tool,
        "--setup",
        json.dumps(dataclasses.asdict(setup)),
    ] + (["--track"] if track else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"worker {tool} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return RunResult(**json.loads(lines[-1][len(RESULT) :]))


def quiet() -> None:
    """Keep the peers' progress bars and notices out of the workers' output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# ------------------------------------------------------------------------------------------ the report


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.2f}"


@dataclass(frozen=True)
class Row:
    tool: str
    plan: str
    step_ms: float
    step_ratio: float  # median over repetitions of (this tool / (a)) in the same repetition
    cpu_ms: float
    cpu_ratio: float  # the same for the process's CPU time per step
    tokens_per_s: float
    tracked: RunResult
    rss_above_start_bytes: int
    cuda_allocated_bytes: int | None
    cuda_reserved_bytes: int | None


def summarise(setup: Setup, timed: dict[str, list[RunResult]], tracked: dict[str, RunResult]) -> list[Row]:
    def median_of(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return int(statistics.median(known)) if known else None

    def per_run(runs: list[RunResult], cpu: bool) -> list[float]:
        return [statistics.median(r.step_cpu_seconds if cpu else r.step_seconds) for r in runs]

    def paired(tool_runs: list[float], hand_runs: list[float]) -> float:
        return statistics.median(t / h for t, h in zip(tool_runs, hand_runs, strict=True))

    rows = []
    hand, hand_cpu = per_run(timed["hand"], cpu=False), per_run(timed["hand"], cpu=True)
    for tool, runs in timed.items():
        medians, cpu = per_run(runs, cpu=False), per_run(runs, cpu=True)
        step = statistics.median(medians)
        rows.append(
            Row(
                tool=tool,
                plan=runs[0].plan,
                step_ms=step * 1000,
                step_ratio=paired(medians, hand),
                cpu_ms=statistics.median(cpu) * 1000,
                cpu_ratio=paired(cpu, hand_cpu),
                tokens_per_s=setup.tokens_per_step / step,
                tracked=tracked[tool],
                rss_above_start_bytes=int(statistics.median(r.rss_above_start_bytes for r in runs)),
                cuda_allocated_bytes=median_of([r.cuda_peak_allocated_bytes for r in runs]),
                cuda_reserved_bytes=median_of([r.cuda_peak_reserved_bytes for r in runs]),
            )
        )
    return rows


def table(rows: list[Row], cuda: bool) -> list[str]:
    base = next(r for r in rows if r.tool == "hand")
    header = (
        "| tool | plan | ms/step | step time × (a) | tokens/s | tokens/s × (a) | tracker peak MiB | × (a) | "
        "peak RSS above start MiB | × (a) |"
    )
    rule = "|---|---|---|---|---|---|---|---|---|---|"
    if not cuda:
        header += " CPU ms/step | CPU time × (a) |"
        rule += "---|---|"
    if cuda:
        header += " CUDA max allocated MiB | × (a) | CUDA max reserved MiB | × (a) |"
        rule += "---|---|---|---|"
    lines = [header, rule]
    for r in rows:
        line = (
            f"| {TOOLS[r.tool]} | {r.plan} | {r.step_ms:.0f} | {r.step_ratio:.3f} | {r.tokens_per_s:.0f} | "
            f"{r.tokens_per_s / base.tokens_per_s:.2f} | {mib(r.tracked.tracker_peak_bytes)} | "
            f"{ratio(r.tracked.tracker_peak_bytes, base.tracked.tracker_peak_bytes)} | "
            f"{mib(r.rss_above_start_bytes)} | {ratio(r.rss_above_start_bytes, base.rss_above_start_bytes)} |"
        )
        if not cuda:
            line += f" {r.cpu_ms:.0f} | {r.cpu_ratio:.3f} |"
        if cuda:
            line += (
                f" {mib(r.cuda_allocated_bytes)} | {ratio(r.cuda_allocated_bytes, base.cuda_allocated_bytes)} | "
                f"{mib(r.cuda_reserved_bytes)} | {ratio(r.cuda_reserved_bytes, base.cuda_reserved_bytes)} |"
            )
        lines.append(line)
    return lines


def components(rows: list[Row]) -> list[str]:
    """The tracker's breakdown at each tool's peak: where the peaks differ."""
    names = ("weights", "gradients", "optimizer_states", "activations", "other")
    lines = ["| tool | peak MiB | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in rows:
        at = r.tracked.tracker_at_peak
        lines.append(
            f"| {TOOLS[r.tool]} | {mib(r.tracked.tracker_peak_bytes)} | "
            + " | ".join(mib(at.get(n, 0)) for n in names)
            + " |"
        )
    return lines


def notes(setup: Setup, params: int, reps: int) -> list[str]:
    return [
        f"Model {setup.model} ({params / 1e6:.1f}M parameters), {setup.global_batch} x {setup.seq_len} tokens per "
        f"step in micro-batches of {setup.micro_batch} ({setup.accumulation} accumulation steps), "
        f"{setup.precision}, AdamW lr {setup.lr:g} constant, clip {setup.grad_clip:g}, device {device().type}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}.",
        "Loss normalisation differs by tool, not the work done: (a) and (c) use the mean cross-entropy per "
        "micro-batch divided by the accumulation steps; (b) HF Trainer passes `num_items_in_batch` to a model "
        "that accepts loss kwargs (Llama does), i.e. sum over the global batch's targets / their count, and "
        "older transformers or models without loss kwargs use the mean per micro-batch / accumulation steps; "
        "(d)/(e) always use sum / tokens of the global batch. (b) gets labels = inputs (the model shifts them): "
        "the same forward size, one target fewer per row.",
        f"Step time: gaps between consecutive optimizer-step ends over {setup.steps} steps, the first "
        f"{setup.warmup} dropped (warm-up); median per run; × (a) is the median over the {reps} interleaved "
        "repetitions of the per-repetition ratio. CPU ms/step (CPU only): the process's CPU time per step, "
        "which other jobs on a shared machine do not inflate as they do wall time (one thread per run).",
        "Tracker peak: live tensor bytes counted by memtrain's MemoryTracker around each tool's loop (2 steps). "
        "Peak RSS: the process's peak resident memory during the run above its RSS before the model was built.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="~17M model, 3 repetitions of 5 steps (CPU: minutes)"
    )
    parser.add_argument(
        "--model",
        choices=tuple(MODELS),
        default=None,
        help="default: llama-58m, with --quick llama-17m (tiny: the smoke test)",
    )
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 5, quick 3)")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per run, the first dropped (default 6, quick 5)"
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16-mixed"),
        default=None,
        help="default: fp32 on CPU, bf16-mixed on CUDA",
    )
    parser.add_argument(
        "--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS)
    )
    parser.add_argument(
        "--no-track",
        action="store_true",
        help="skip the tracked runs (tracker columns n/a): for a tight time box",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--worker", choices=tuple(TOOLS), help=argparse.SUPPRESS)
    parser.add_argument("--setup", help=argparse.SUPPRESS)
    parser.add_argument("--track", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quiet()
    if args.worker:
        raw = json.loads(args.setup)
        setup = Setup(**{**raw, "betas": tuple(raw["betas"])})
        print(RESULT + json.dumps(dataclasses.asdict(run_tool(args.worker, setup, args.track))), flush=True)
        return

    setup = Setup(
        model=args.model or ("llama-17m" if args.quick else "llama-58m"),
        steps=args.steps or (5 if args.quick else 6),
        precision=args.precision or ("bf16-mixed" if device().type == "cuda" else "fp32"),
    )
    reps = args.reps or (3 if args.quick else 5)
    tools = [t for t in args.tools.split(",") if t]
    if "hand" not in tools or any(t not in TOOLS for t in tools):
        parser.error(f"--tools: a subset of {','.join(TOOLS)} that includes hand (the baseline)")
    started = time.perf_counter()
    timed: dict[str, list[RunResult]] = {t: [] for t in tools}
    for rep in range(reps):
        for tool in tools if rep % 2 == 0 else list(reversed(tools)):
            result = spawn(tool, setup, track=False)
            timed[tool].append(result)
            print(
                f"rep {rep + 1}/{reps} {tool}: {statistics.median(result.step_seconds) * 1000:.0f} ms/step, "
                f"CPU {statistics.median(result.step_cpu_seconds) * 1000:.0f} ms/step, "
                f"RSS +{mib(result.rss_above_start_bytes)} MiB",
                flush=True,
            )
    tracked = {tool: RunResult(tool=tool, plan=timed[tool][0].plan) for tool in tools}
    for tool in [] if args.no_track else tools:
        tracked[tool] = spawn(tool, setup, track=True)
        print(f"tracked {tool}: peak {mib(tracked[tool].tracker_peak_bytes)} MiB", flush=True)
    rows = summarise(setup, timed, tracked)
    params = sum(p.numel() for p in build_model(setup).parameters())
    elapsed = time.perf_counter() - started
    lines = (
        table(rows, device().type == "cuda")
        + ["", "Tracker breakdown at each tool's peak (MiB):", ""]
        + components(rows)
        + [""]
        + [f"- {n}" for n in notes(setup, params, reps)]
        + [f"- Wall time of this benchmark: {elapsed:.0f} s."]
    )
    write_report(
        lines,
        {
            "setup": dataclasses.asdict(setup),
            "reps": reps,
            "device": device().type,
            "params": params,
            "seconds": elapsed,
            "timed": {t: [dataclasses.asdict(r) for r in rs] for t, rs in timed.items()},
            "tracked": {t: dataclasses.asdict(r) for t, r in tracked.items()},
            "rows": [
                {
                    "tool": r.tool,
                    "plan": r.plan,
                    "step_ms": r.step_ms,
                    "step_ratio": r.step_ratio,
                    "cpu_ms": r.cpu_ms,
                    "cpu_ratio": r.cpu_ratio,
                    "tokens_per_s": r.tokens_per_s,
                    "rss_above_start_bytes": r.rss_above_start_bytes,
                    "tracker_peak_bytes": r.tracked.tracker_peak_bytes,
                    "cuda_allocated_bytes": r.cuda_allocated_bytes,
                    "cuda_reserved_bytes": r.cuda_reserved_bytes,
                }
                for r in rows
            ],
        },
        args.markdown,
        args.json,
    )


if __name__ == "__main__":
    main()
