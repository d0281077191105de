"""The CUDA half of scripts/bench_fit_budget.py. How much fits under a memory budget: the largest batch of 4096-token sequences that HF Trainer
(`auto_find_batch_size`, gradient checkpointing on), an accelerate loop (`find_executable_batch_size`,
gradient checkpointing on) and memtrain (`strategies: auto`) train without running out of memory, and their
tokens/s there, for a ~1.1B Llama-style model on a device made to look like a 24, 40 and 80 GiB GPU.

Why: "fits more in the memory you have, at equal or better speed" is memtrain's claim against what users
run today (goal: >= 1.5x the tokens per step of the best peer). The batch is sequences per optimizer step
*in one micro-batch*: with gradient accumulation every tool reaches any global batch, so the comparison is
what one forward/backward can hold. Everyone trains bf16-mixed (fp32 weights, bf16 autocast) with torch's
AdamW; memtrain chooses its checkpointing and optimizer states itself (its `auto` keeps fp32-like
numerics, so bf16-master, fp16 and fp8 are not among its choices).

How the budgets are made: the CUDA context stays outside the caching allocator, so each budget limits the
allocator to (budget - context) with `torch.cuda.set_per_process_memory_fraction`, and
`torch.cuda.mem_get_info` is made to report that device (total = budget), because memtrain's planner plans
for the free memory the device reports. Each tool runs in its own process, budgets in increasing order.

Probes (2-3 steps each, the first untimed):
- HF Trainer from `--start` sequences per device with `auto_find_batch_size=True` (it retries at 0.9x on OOM);
- accelerate: `find_executable_batch_size(starting_batch_size=--start)` around the loop of its docs, except
  that the model is built once per process (rebuilding a 1.1B model per attempt would take the time box);
- memtrain: a binary search over the batch up to 4x the peers' first batch, in which a batch the planner
  cannot fit costs only planning (`PlanError` before anything is allocated); the largest planned batch
  then trains. A step that runs out of memory anyway, or whose measured peak passes the budget, makes
  memtrain split the batch (accumulation): that batch counts as not fitting, and 0.9x of it is tried.

On a machine without CUDA it prints "skipped: needs CUDA" and exits 0.

Run through scripts/bench_fit_budget.py (without --cpu); `run(args)` is its CUDA half.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from bench_vs_peers import QUIET_HF_ARGS, RowsDataset, StepClock, TimedTrainer, quiet, write_report
from torch import nn

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer, build_config
from memtrain.errors import PlanError

GiB = 2**30
SCRIPT = Path(__file__).resolve().parent.parent / "bench_fit_budget.py"  # the CLI that runs each worker
RESULT = "fit-result: "  # prefix of the worker's JSON lines (HF Trainer prints dicts of its own)

MODELS: dict[str, dict[str, Any]] = {
    # TinyLlama-1.1B's shape: 1.10B parameters.
    "llama-1.1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    # --cpu-smoke: every code path on the CPU in seconds (no budget, no OOM), for tests.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
    },
}
TOOLS = ("hf", "accelerate", "memtrain")
# Shares of the time box, run in this order: memtrain plans each batch it tries (a few seconds of CPU each)
# before it trains, the peers only train. Time a tool leaves unused passes to the ones after it.
SHARES = {"memtrain": 0.4, "hf": 0.3, "accelerate": 0.3}
LABELS = {"hf": "HF Trainer", "accelerate": "accelerate", "memtrain": "memtrain auto"}
PEER_PLAN = f"{'bf16-mixed' if torch.cuda.is_available() else 'fp32'}, gradient checkpointing, torch AdamW"
START = {24: 8, 40: 16, 80: 32}  # first batch tried per budget (GiB); the peers only go down from here


@dataclass(frozen=True)
class Probe:
    model: str
    seq_len: int
    steps: int
    lr: float = 1e-4
    grad_clip: float = 1.0


@dataclass
class Fit:
    tool: str
    budget_gib: int
    batch: int = 0  # sequences per step, one micro-batch; 0: none fitted
    tokens_per_step: int = 0
    tokens_per_s: float = 0.0
    plan: str = ""
    attempts: int = 0
    seconds: float = 0.0
    note: str = ""
    history: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ the device


class Budget:
    """Make this process's CUDA device look like a GPU of `gib` GiB (see the module docstring)."""

    def __init__(self) -> None:
        free, self.total = torch.cuda.mem_get_info()
        self.context = self.total - free - torch.cuda.memory_reserved()  # measured before any allocation
        self.limit = self.total
        self._real_mem_get_info = torch.cuda.mem_get_info
        torch.cuda.mem_get_info = self._mem_get_info  # type: ignore[assignment]

    def set(self, gib: int) -> None:
        self.budget = gib * GiB
        self.limit = self.budget - self.context
        torch.cuda.set_per_process_memory_fraction(self.limit / self.total)

    def _mem_get_info(self, device: Any = None) -> tuple[int, int]:
        if self.limit == self.total:
            return self._real_mem_get_info(device)
        return max(0, self.limit - torch.cuda.memory_reserved(device)), self.budget


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def tokens_per_s(clock: StepClock, batch: int, seq_len: int) -> float:
    gaps = clock.step_seconds(warmup=1)
    return batch * seq_len / (sum(gaps) / len(gaps)) if gaps else 0.0


def random_rows(probe: Probe, rows: int) -> RowsDataset:
    vocab = int(MODELS[probe.model]["vocab_size"])
    ids = torch.randint(0, vocab, (rows, probe.seq_len), generator=torch.Generator().manual_seed(0))
    return RowsDataset([{"input_ids": ids, "labels": ids}], labels_are_inputs=True)


def build_model(probe: Probe) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        build_config(memtrain_recipe(probe, 1, Path(tempfile.gettempdir())))
    )


# ------------------------------------------------------------------------------------------ the tools


def fit_hf(probe: Probe, model: nn.Module, start: int, result: Fit) -> None:
    """HF Trainer as its docs recommend for "find the batch size that fits": auto_find_batch_size and
    gradient checkpointing; torch AdamW and a constant schedule as everywhere here."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.reset()  # a new attempt after an OOM
            result.attempts += 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=start,
            gradient_accumulation_steps=1,
            auto_find_batch_size=True,
            gradient_checkpointing=True,
            bf16=torch.cuda.is_available(),
            use_cpu=not torch.cuda.is_available(),
            max_steps=probe.steps,
            learning_rate=probe.lr,
            max_grad_norm=probe.grad_clip,
            optim="adamw_torch",
            dataloader_pin_memory=False,
            **QUIET_HF_ARGS,
            seed=0,
        )
        trainer = Trainer(
            model=model, args=args, train_dataset=random_rows(probe, start * probe.steps), callbacks=[Clock()]
        )
        trainer.train()
        result.batch = int(trainer.state.train_batch_size or start)
        result.plan = PEER_PLAN
        del trainer
    result.tokens_per_s = tokens_per_s(clock, result.batch, probe.seq_len)


def fit_accelerate(probe: Probe, accelerator: Any, model: nn.Module, start: int, result: Fit) -> None:
    """The accelerate loop with `find_executable_batch_size` (0.9x per OOM) and gradient checkpointing;
    `model` was prepared once by `accelerator` (see `run_worker`)."""
    from accelerate.utils import find_executable_batch_size

    data = random_rows(probe, start * probe.steps)
    clock = StepClock()

    @find_executable_batch_size(starting_batch_size=start)
    def train(batch_size: int) -> int:
        accelerator.free_memory()
        model.zero_grad(set_to_none=True)
        clock.reset()
        result.attempts += 1
        optimizer = torch.optim.AdamW(model.parameters(), lr=probe.lr, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
        optimizer, loader = accelerator.prepare(optimizer, loader)
        model.train()
        for step, batch in enumerate(loader):
            if step == probe.steps:
                break
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), probe.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()
            del loss
            clock.tick()
        return batch_size

    result.batch = train()
    result.plan = PEER_PLAN
    result.tokens_per_s = tokens_per_s(clock, result.batch, probe.seq_len)
    accelerator.free_memory()


def memtrain_recipe(probe: Probe, batch: int, out: Path) -> CausalLMRecipe:
    """The user's recipe: a global batch in one micro-batch, every strategy left to memtrain."""
    return CausalLMRecipe.from_dict(
        {
            "run": {"name": "fit", "output_dir": str(out), "seed": 0},
            "model": {"config": MODELS[probe.model]},
            "data": {
                "source": "synthetic",
                "seq_len": probe.seq_len,
                "synthetic": {"num_samples": 2 * batch + 16},
            },
            "batch": {"global_size": batch, "micro_size": batch},
            "train": {
                "steps": probe.steps,
                "lr": probe.lr,
                "weight_decay": 0.0,
                "min_lr_ratio": 1.0,
                "grad_clip": probe.grad_clip,
                "eval_every": 0,
            },
            "checkpoint": {"every": 0, "at_end": False},
            "output": {"progress": "off"},
            "strategies": {
                "precision": "auto",
                "checkpointing": "auto",
                "optimizer_states": "auto",
                "sharding": "auto",
            },
        }
    )


def fit_memtrain(probe: Probe, start: int, result: Fit) -> None:
    """Binary search by planning (no memory used), then train the largest planned batch."""

    def plans(batch: int) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                CausalLMTrainer(memtrain_recipe(probe, batch, Path(tmp)))
            except PlanError:
                result.history.append(f"{batch}: no plan fits")
                return False
        result.history.append(f"{batch}: planned")
        return True

    low, high = 0, 4 * start  # plans(low) holds (0 trivially); search the largest batch that plans
    while low < high:
        middle = (low + high + 1) // 2
        if plans(middle):
            low = middle
        else:
            high = middle - 1
    batch = low
    while batch > 0:
        result.attempts += 1
        clock = StepClock()
        with tempfile.TemporaryDirectory() as tmp:
            trainer = TimedTrainer(memtrain_recipe(probe, batch, Path(tmp)), clock.tick)
            try:
                trainer.fit()
                # out of memory (re-split), or a measured peak past the budget (re-planned): accumulation
                recovered = bool(trainer.monitor.oom_events) or trainer.plan.micro_batch_size != batch
            except torch.OutOfMemoryError:
                recovered = True
            p = trainer.plan
            del trainer
        release()
        if not recovered:
            result.batch = batch
            result.plan = p.describe()
            result.tokens_per_s = tokens_per_s(clock, batch, probe.seq_len)
            return
        result.history.append(f"{batch}: planned, but a step ran out of memory or past the budget")
        batch = int(batch * 0.9)


def run_worker(tool: str, probe: Probe, budgets: list[int], deadline: float) -> None:
    """One tool at every budget, in this process; one JSON line per budget as soon as it is known."""
    budget = Budget() if torch.cuda.is_available() else None
    model = build_model(probe).to("cuda" if budget else "cpu") if tool != "memtrain" else None
    accelerator = None
    if tool == "accelerate" and model is not None:
        from accelerate import Accelerator

        accelerator = Accelerator(mixed_precision="bf16" if budget else "no", cpu=budget is None)
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        model = accelerator.prepare_model(model)
    for gib in budgets:
        result = Fit(tool=tool, budget_gib=gib)
        started = time.perf_counter()
        if time.time() > deadline:
            result.note = "skipped: the time box ran out"
        else:
            if budget is not None:
                budget.set(gib)
            start = START.get(gib, 8) if budget is not None else 4
            try:
                if tool == "hf":
                    assert model is not None
                    fit_hf(probe, model, start, result)
                elif tool == "accelerate":
                    assert model is not None
                    fit_accelerate(probe, accelerator, model, start, result)
                else:
                    fit_memtrain(probe, start, result)
            except Exception as exc:  # a peer that finds no batch at all raises; report it as a row
                result.note = f"{'out of memory' if is_oom(exc) else type(exc).__name__}: {str(exc)[:160]}"
            if result.batch and result.batch >= start and tool != "memtrain":
                result.note = f"fits its first try ({start}): the true maximum may be higher"
            if tool == "memtrain" and result.batch == 4 * start:
                result.note = f"the top of the search ({4 * start}): the true maximum may be higher"
        result.tokens_per_step = result.batch * probe.seq_len
        result.seconds = time.perf_counter() - started
        release()
        print(RESULT + json.dumps(dataclasses.asdict(result)), flush=True)


# ------------------------------------------------------------------------------------------ main


def spawn(tool: str, probe: Probe, budgets: list[int], deadline: float, cpu_smoke: bool) -> list[Fit]:
    command = [
        sys.executable,
        str(SCRIPT),
        "--worker",
        tool,
        "--model",
        probe.model,
        "--seq-len",
        str(probe.seq_len),
        "--steps",
        str(probe.steps),
        "--budgets",
        ",".join(map(str, budgets)),
        "--deadline",
        str(deadline),
    ]
    if cpu_smoke:
        command.append("--cpu-smoke")
    timeout = max(30.0, deadline - time.time() + 60)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        stdout, note = (
            done.stdout,
            "" if done.returncode == 0 else f"worker exit {done.returncode}: {done.stderr[-300:]}",
        )
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        note = "worker killed at the time box"
    fits = [Fit(**json.loads(line[len(RESULT) :])) for line in stdout.splitlines() if line.startswith(RESULT)]
    known = {f.budget_gib for f in fits}
    fits += [Fit(tool=tool, budget_gib=gib, note=note or "no result") for gib in budgets if gib not in known]
    return sorted(fits, key=lambda f: f.budget_gib)


def table(results: dict[str, list[Fit]], budgets: list[int], seq_len: int) -> list[str]:
    lines = [
        "| budget | tool | batch x seq | tokens/step | tokens/s | plan | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for gib in budgets:
        for tool in TOOLS:
            f = next(x for x in results[tool] if x.budget_gib == gib)
            lines.append(
                f"| {gib} GiB | {LABELS[tool]} | {f.batch} x {seq_len} | {f.tokens_per_step} | "
                f"{f.tokens_per_s:.0f} | {f.plan} | {f.note} |"
            )
    lines += [
        "",
        "| budget | memtrain tokens/step ÷ best peer | memtrain tokens/s ÷ that peer's | goal |",
        "|---|---|---|---|",
    ]
    for gib in budgets:
        ours = next(x for x in results["memtrain"] if x.budget_gib == gib)
        peers = [next(x for x in results[t] if x.budget_gib == gib) for t in ("hf", "accelerate")]
        best = max(peers, key=lambda f: (f.tokens_per_step, f.tokens_per_s))
        if best.tokens_per_step and ours.tokens_per_step:
            lines.append(
                f"| {gib} GiB | {ours.tokens_per_step / best.tokens_per_step:.2f} | "
                f"{ours.tokens_per_s / best.tokens_per_s:.2f} | >= 1.5 at >= 1.0 |"
            )
        else:
            lines.append(f"| {gib} GiB | n/a | n/a | >= 1.5 at >= 1.0 |")
    return lines


def run(args: argparse.Namespace) -> None:
    """The CUDA benchmark (or, with --cpu-smoke, its code paths on the CPU) from bench_fit_budget's flags."""
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("skipped: needs CUDA (torch.cuda.is_available() is False); nothing measured")
        return
    quiet()
    budgets = sorted(int(b) for b in args.budgets.split(",") if b)
    probe = Probe(model=args.model, seq_len=args.seq_len, steps=args.steps)
    if args.worker:
        run_worker(args.worker, probe, budgets, args.deadline)
        return
    started = time.perf_counter()
    deadline = time.time() + args.time_budget
    results: dict[str, list[Fit]] = {}
    order = list(SHARES)
    for index, tool in enumerate(order):
        share = (deadline - time.time()) * SHARES[tool] / sum(SHARES[t] for t in order[index:])
        results[tool] = spawn(tool, probe, budgets, time.time() + share, args.cpu_smoke)
        for f in results[tool]:
            print(
                f"{LABELS[tool]} at {f.budget_gib} GiB: batch {f.batch}, {f.tokens_per_s:.0f} tokens/s "
                f"{f.note}",
                flush=True,
            )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run, no budget)"
    lines = table(results, budgets, probe.seq_len) + [
        "",
        f"- Model {probe.model}, sequences of {probe.seq_len} tokens, {probe.steps} steps per probe, on {device}, "
        f"torch {torch.__version__}; wall time {time.perf_counter() - started:.0f} s.",
        "- batch: sequences per optimizer step in one micro-batch (no gradient accumulation).",
    ]
    report = {
        "probe": dataclasses.asdict(probe),
        "device": device,
        "budgets_gib": budgets,
        "results": {t: [dataclasses.asdict(f) for f in fs] for t, fs in results.items()},
    }
    write_report(lines, report, args.markdown, args.json)
