"""One training run of one tool under memtrain's simulated budget, the same way for every tool.

Why this shape: the claim "more fits in the memory you have" is only measured if every tool meets the
same limit, counted the same way. `SimulatedBudget(n)` raises a real `torch.OutOfMemoryError` (a message
HF Trainer's `auto_find_batch_size` and accelerate's `find_executable_batch_size` both recognise) the
moment live storage bytes would pass n; memtrain gets the same n as `memory.budget`, which runs the same
accounting (a MemoryTracker with that budget) around its own steps. Each run builds the model fresh
(identical weights), outside the budget: the weights count from their first use, as memtrain's do.

The peers are set up as their documentation shows: HF `Trainer` (torch AdamW, constant learning rate,
sequential order, no eval or saving), optionally with `gradient_checkpointing`; the "expert" HF
configuration adds bitsandbytes' 8-bit AdamW and bf16 autocast; the accelerate loop of its docs with
manual gradient accumulation, optionally with the model's gradient checkpointing. memtrain runs
`strategies: auto` with the budget as `memory.budget`.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bench_vs_peers import QUIET_HF_ARGS, StepClock, TimedTrainer
from torch import nn

from fit_kit.cpu_setup import MEMTRAIN_TOOLS, CpuSetup, Rows, build_model, memtrain_recipe
from memtrain.memory.tracker import SimulatedBudget

UNLIMITED = 2**62  # the reference run: the tracker counts, nothing is refused
HF_CHECKPOINTING = ("hf-ckpt", "hf-expert")


@dataclass(frozen=True)
class Job:
    """One run: the ladder rung and sequence length of the model and data, `micro` sequences per
    micro-batch (None: the tool's own search; the peers start from the global batch in one micro-batch),
    `steps` optimizer steps of which the first `warmup` are not timed."""

    rung: int
    seq_len: int
    micro: int | None
    global_batch: int
    steps: int
    budget_bytes: int | None
    warmup: int = 1


@dataclass
class Outcome:
    ok: bool = False
    note: str = ""  # why it failed; or, when it trained, what the tool did on the way (retries, re-plans)
    micro: int = 0  # sequences per micro-batch it trained with
    accumulation: int = 0
    plan: str = ""
    tokens_per_s: float = 0.0  # median over the timed steps, wall clock
    tokens_per_cpu_s: float = 0.0  # the same over the process's CPU time (less disturbed on a shared CPU)
    peak_bytes: int = 0  # the budget tracker's peak over the whole run
    attempts: int = 0  # trainings started (the peers' own searches retry after an OOM)
    seconds: float = 0.0


def run(tool: str, setup: CpuSetup, job: Job) -> Outcome:
    started = time.perf_counter()
    if tool in MEMTRAIN_TOOLS:
        outcome = run_memtrain(setup, job, clip=tool == "memtrain")
    else:
        outcome = run_peer(tool, setup, job)
    outcome.seconds = time.perf_counter() - started
    gc.collect()
    return outcome


def reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, torch.OutOfMemoryError) or " out of memory" in text:
        return "out of memory: " + text[:140]
    return f"{type(exc).__name__}: {text[:160]}"


def speeds(clock: StepClock, warmup: int, tokens_per_step: int) -> tuple[float, float]:
    wall, cpu = clock.step_seconds(warmup), clock.step_seconds(warmup, cpu=True)
    if not wall:
        return 0.0, 0.0
    return tokens_per_step / statistics.median(wall), tokens_per_step / max(statistics.median(cpu), 1e-9)


# ------------------------------------------------------------------------------------------ the peers


def run_peer(tool: str, setup: CpuSetup, job: Job) -> Outcome:
    model = build_model(setup, job.rung, checkpointing=tool == "accelerate-ckpt")
    search = job.micro is None
    micro = job.global_batch if search else job.micro
    assert micro is not None
    accumulation = 1 if search else job.global_batch // micro
    rows = Rows(setup, job.seq_len, micro * accumulation * job.steps)
    clock = StepClock()
    outcome = Outcome()
    budget = SimulatedBudget(job.budget_bytes if job.budget_bytes is not None else UNLIMITED)
    train = train_hf if tool.startswith("hf") else train_accelerate
    with budget:
        budget.begin_step(1)
        try:
            micro = train(tool, setup, model, rows, (micro, accumulation, job.steps), search, clock, outcome)
            outcome.ok = True
        except Exception as exc:  # an OOM, or the peer's own search reaching zero: a reason in the table
            outcome.note = reason(exc)
        outcome.peak_bytes = budget.end_step().peak_bytes
    if outcome.ok:
        outcome.micro, outcome.accumulation = micro, accumulation
        outcome.tokens_per_s, outcome.tokens_per_cpu_s = speeds(
            clock, job.warmup, micro * accumulation * job.seq_len
        )
        if outcome.attempts > 1:
            outcome.note = f"{outcome.attempts - 1} attempt(s) ran out of memory first"
    return outcome


Shape = tuple[int, int, int]  # (micro, accumulation, steps)


def train_hf(
    tool: str,
    setup: CpuSetup,
    model: nn.Module,
    rows: Rows,
    shape: Shape,
    search: bool,
    clock: StepClock,
    outcome: Outcome,
) -> int:
    """HF Trainer; with `search`, `auto_find_batch_size` (0.9x per OOM). Returns the micro-batch it ran."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    micro, accumulation, steps = shape

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.reset()  # a new attempt after an OOM
            outcome.attempts += 1

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()

    expert = tool == "hf-expert"
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            auto_find_batch_size=search,
            gradient_checkpointing=tool in HF_CHECKPOINTING,
            bf16=expert,
            optim="adamw_bnb_8bit" if expert else "adamw_torch",
            use_cpu=True,
            max_steps=steps,
            learning_rate=setup.lr,
            max_grad_norm=setup.grad_clip,
            dataloader_pin_memory=False,
            **QUIET_HF_ARGS,
            seed=setup.seed,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()])
        trainer.train()
        found = int(trainer.state.train_batch_size or micro)
        del trainer
    return found


_accelerator: Any = None


def train_accelerate(
    tool: str,
    setup: CpuSetup,
    model: nn.Module,
    rows: Rows,
    shape: Shape,
    search: bool,
    clock: StepClock,
    outcome: Outcome,
) -> int:
    """The accelerate loop of its docs (loss / accumulation steps, `backward`, `clip_grad_norm_`, step);
    with `search`, wrapped in `find_executable_batch_size` (0.9x per OOM). One Accelerator per process."""
    global _accelerator
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size

    if _accelerator is None:
        _accelerator = Accelerator(cpu=True)
    accelerator = _accelerator
    micro, accumulation, steps = shape

    def train(batch_size: int) -> int:
        accelerator.free_memory()
        model.zero_grad(set_to_none=True)
        clock.reset()
        outcome.attempts += 1
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
        loader = torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=False)
        prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        prepared.train()
        for index, batch in enumerate(loader):
            if index == steps * accumulation:
                break
            loss = prepared(input_ids=batch["input_ids"], labels=batch["labels"]).loss / accumulation
            accelerator.backward(loss)
            del loss
            if (index + 1) % accumulation == 0:
                accelerator.clip_grad_norm_(prepared.parameters(), setup.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                clock.tick()
        accelerator.free_memory()
        return batch_size

    if search:
        found: int = find_executable_batch_size(train, starting_batch_size=micro)()
        return found
    return train(micro)


# ------------------------------------------------------------------------------------------ memtrain


def run_memtrain(setup: CpuSetup, job: Job, clip: bool = True) -> Outcome:
    """memtrain `auto` with `memory.budget`; a plan it cannot find (`PlanError`), or an error it does not
    recover from, is the reason. Re-plans and OOM recoveries on the way are noted (it still trained)."""
    assert job.budget_bytes is not None, "memtrain always runs under a budget here"
    clock = StepClock()
    outcome = Outcome(attempts=1)
    global_batch = job.global_batch
    with tempfile.TemporaryDirectory() as tmp:
        recipe = memtrain_recipe(
            setup,
            Path(tmp),
            rung=job.rung,
            seq_len=job.seq_len,
            global_batch=global_batch,
            micro=job.micro,
            steps=job.steps,
            budget_bytes=job.budget_bytes,
            clip=clip,
        )
        trainer = TimedTrainer(recipe, clock.tick)
        try:
            trainer.setup()
            trainer.fit()
            outcome.ok = True
        except Exception as exc:  # no plan fits (PlanError), an OOM it did not recover from, or a failure
            outcome.note = reason(exc)
        if trainer.plan_result is not None:
            plan = trainer.plan_result.plan
            outcome.plan = plan.describe()
            outcome.micro, outcome.accumulation = plan.micro_batch_size, plan.accumulation_steps
        if trainer.monitor.memory_reports:
            outcome.peak_bytes = max(r.peak_bytes for r in trainer.monitor.memory_reports)
        if outcome.ok and job.micro is not None and outcome.micro != job.micro:
            outcome.ok = False  # it re-split the pinned micro-batch after an OOM: that one did not fit
            outcome.note = f"micro {job.micro} ran out of memory; memtrain re-split it to {outcome.micro}"
        elif outcome.ok and (trainer.monitor.oom_events or trainer.monitor.replans):
            outcome.note = (
                f"trained after {len(trainer.monitor.oom_events)} OOM recovery(ies) and "
                f"{len(trainer.monitor.replans)} re-plan(s)"
            )
        trainer.close()
        del trainer
    if outcome.ok:
        outcome.tokens_per_s, outcome.tokens_per_cpu_s = speeds(clock, job.warmup, global_batch * job.seq_len)
    return outcome


def cache_planner_traces() -> None:
    """Reuse memtrain's planner traces within this process. The planner traces the model once per
    (precision, checkpointing, loss, micro-batch range) in a `ModelProbe` it builds per plan; the
    searches here plan the same model and length at several budgets, identical traces each time. One
    probe per (model, data) section keeps them: what is planned is unchanged, only the benchmark's own
    wall time (planning is never inside a timed step)."""
    import memtrain.planner as planner

    build: Callable[..., Any] = planner._probe
    probes: dict[str, Any] = {}

    def cached(recipe: Any, spec: Any, progress: Any) -> Any:
        key = json.dumps([recipe.model.model_dump(mode="json"), recipe.data.model_dump(mode="json")])
        if key not in probes:
            probes[key] = build(recipe, spec, progress)
        return probes[key]

    planner._probe = cached
