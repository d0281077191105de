"""`Trainer`: the one training loop, with small hooks for users to subclass.

The Trainer owns micro-batching. Each step it takes this rank's step batch, splits it into
micro-batches, counts the loss tokens of the *whole global* step first (one all-reduce), and
back-propagates `loss_sum * sync_scale / global_tokens` per micro-batch. The gradient therefore equals
that of the mean loss over every token of the global batch, whatever the micro-batch size, the number
of ranks or the padding — which is what lets the planner change micro-batching under a run without
changing its meaning. (Dividing by the number of micro-steps instead would weight a short micro-batch's
tokens more than a long one's; tests/test_accumulation.py shows that this is detectable.)

Hooks (override in a subclass):
    build_model()                     -> nn.Module
    build_optimizer(params)           -> torch.optim.Optimizer   (default: AdamW from `train:`)
    step_batch(step)                  -> dict of tensors: this rank's share of the step's global batch
    loss(model, micro_batch)          -> (loss_sum, num_tokens)
    count_tokens(micro_batch)         -> int                     (default: labels != -100)
    split_batch(batch, micro_size)    -> list of micro-batches   (default: slices along dim 0)
    eval_batches()                    -> iterable of batches     (default: none)
    blocks(model)                     -> the repeated blocks strategies wrap (default: discovered)

The planner predicts the job these hooks describe (`model_spec()`): it calls `build_model` on the meta
device and under fake tensors, `loss` on micro-batches shaped like `planning_batch(rows)` (default: rows
of `step_batch(0)`), and counts `host_data_bytes()`. Planning happens in `setup()` (or an explicit
`choose_plan()`), once the subclass is fully constructed.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from memtrain import checkpoint as ckpt
from memtrain import json_out
from memtrain.distributed import DistEnv, all_reduce_sum, barrier, init_distributed, shutdown
from memtrain.errors import MemtrainError, PlanError, TrainingStopped
from memtrain.memory import MemoryTracker, StepMemory, StepPeak, format_bytes
from memtrain.plan import Plan
from memtrain.planner import ModelSpec, PlanResult, calibration, make_plan, step_time_calibration
from memtrain.recipe import Recipe
from memtrain.strategies.apply import apply_strategies, switch_in_place
from memtrain.strategies.blocks import discover_blocks, model_shape
from memtrain.strategies.master_weights import MasterWeightOptimizer
from memtrain.strategies.optimizer_step import InBackwardOptimizer
from memtrain.strategies.sharding.base import ShardingBackend
from memtrain.training import lineage, replan, run_lock
from memtrain.training.loggers import (
    ProgressLine,
    check_loggers,
    close_loggers,
    log_row,
    make_loggers,
    wants_progress_line,
)
from memtrain.training.metrics import make_progress
from memtrain.training.preemption import PreemptionFlag
from memtrain.training.schedule import lr_at

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100
CALIBRATION_STEPS = 2  # the first step differs (lazy optimizer state, allocator warm-up): compare two
STEP_TIME_STEPS = 3  # steps after a plan's first whose median time is compared with its predicted step time


@dataclass
class FitResult:
    run_dir: Path
    plan: Plan
    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    steps_done: int = 0
    preempted: bool = False  # stopped by a signal after a checkpoint
    stopped_by: str | None = None  # that signal: "SIGTERM" (exit 0) or "SIGINT" (Ctrl-C, exit 130)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepTotals:
    loss_sum: torch.Tensor  # this rank's summed loss (float64 scalar)
    global_tokens: int  # loss tokens of the step over all ranks
    micro_batches: int


class Trainer:
    """Subclass and override the hooks; call `fit()`."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.env: DistEnv = init_distributed()
        self.plan_result: PlanResult | None = None  # set by choose_plan() (setup() calls it)
        self._plan: Plan | None = None
        self.sharding: ShardingBackend | None = None
        self.calibration: list[dict[str, Any]] = []  # the first steps: predicted against measured
        self.step_time: dict[str, Any] | None = None  # rank 0: predicted against measured step time
        self._step_times: list[float] = []  # rank 0: the seconds of the steps timed so far, of `_timed_plan`
        self._timed_plan: PlanResult | None = None
        self.run_dir = recipe.output_path()
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.skipped_steps = 0
        self.step_peak = StepPeak(self.env.device)
        self.max_step_peak = 0
        self.tracker: MemoryTracker | None = None
        self.memory_reports: list[StepMemory] = []
        self.oom_events: list[dict[str, Any]] = []  # out-of-memory errors recovered from, in order
        self.replans: list[dict[str, Any]] = []  # plans switched to during the run (training/replan.py)
        self.correction = replan.Correction()  # what the run measured beyond the predictions, so far
        self._calibrate_until = 0  # the steps before this one compare their measured peak with the plan
        self._blocks: list[nn.Module] = []  # the blocks strategies wrapped (a re-plan re-wraps them)
        self.device_peaks: list[int] = []  # the cheap per-step peak, kept beside tracked reports
        self.segment: lineage.Segment | None = None  # rank 0: the lineage fit() continues (in meta.json)

    # ------------------------------------------------------------------------------------ hooks

    def build_model(self) -> nn.Module:
        raise NotImplementedError("subclass Trainer and implement build_model()")

    def build_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW with `train:` settings over the trainable parameters, its states stored as the plan's
        `optimizer_states` says."""
        t = self.recipe.train
        return self.plan.optimizer_states.build(
            params, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
        )

    def step_batch(self, step: int) -> Batch:
        raise NotImplementedError("subclass Trainer and implement step_batch(step)")

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int | torch.Tensor]:
        raise NotImplementedError(
            "subclass Trainer and implement loss(model, batch) -> (loss_sum, num_tokens)"
        )

    def count_tokens(self, batch: Batch) -> int:
        if "labels" not in batch:
            raise MemtrainError("count_tokens: the batch has no 'labels'; override Trainer.count_tokens")
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def split_batch(self, batch: Batch, micro_size: int) -> list[Batch]:
        """Slices of `micro_size` rows, or the row groups of the plan's micro-batching (a token budget)."""
        groups = self.plan.micro_batching.split(batch, self.row_tokens)
        if groups is not None:
            return [{k: v[torch.tensor(rows)] for k, v in batch.items()} for rows in groups]
        rows = next(iter(batch.values())).shape[0]
        return [{k: v[i : i + micro_size] for k, v in batch.items()} for i in range(0, rows, micro_size)]

    def row_tokens(self, batch: Batch) -> list[int]:
        """Each row's length up to its last loss token (what a micro-batch pads to)."""
        real = batch["labels"] != IGNORE_INDEX
        positions = torch.arange(1, real.shape[1] + 1).expand_as(real)
        return (positions * real).amax(dim=1).tolist()

    def eval_batches(self) -> Iterable[Batch]:
        return []

    # ------------------------------------------------------------------------------------ planning

    def planning_batch(self, rows: int) -> Batch:
        """A micro-batch of `rows` rows shaped like the largest this trainer feeds: by default the rows of
        `step_batch(0)`, repeated or cut to `rows` (tensors without a row dimension are kept as they are).
        Override when later steps carry longer rows than step 0."""
        batch = self.step_batch(0)
        count = max((v.shape[0] for v in batch.values() if v.dim()), default=1)
        index = torch.arange(rows) % count
        return {k: v[index] if v.dim() and v.shape[0] == count else v for k, v in batch.items()}

    def load_weights(self, model: nn.Module) -> None:
        """Fill the parameters of a model `build_model()` left on the meta device (pretrained weights),
        once the plan has placed them: called only for such a model, with this rank's share materialised
        (whole tensors for replicated plans, DTensor shards for FSDP2)."""
        raise MemtrainError(
            f"{type(self).__name__}.build_model() left parameters on the meta device; override load_weights()"
        )

    def build_model_clone(self, num_blocks: int) -> nn.Module | None:
        """The same model with `num_blocks` blocks, or None. The planner traces three blocks of such a clone
        instead of the whole model (faster for deep models; the built-in causal-LM trainer builds one)."""
        return None

    def host_data_bytes(self) -> int:
        """Bytes of training data this trainer keeps in host memory (on a CPU, host memory is the device)."""
        return 0

    def model_spec(self) -> ModelSpec:
        """The job the planner predicts: this trainer's own hooks."""
        clone = self.build_model_clone
        overridden = type(self).build_model_clone is not Trainer.build_model_clone
        return ModelSpec(
            build_model=self.build_model,
            blocks=self.blocks,
            micro_batch=self.planning_batch,
            loss=self.loss,
            build_clone=clone if overridden else None,  # type: ignore[arg-type]
            host_bytes=self.host_data_bytes,
            name=f"{type(self).__name__}.build_model()",
        )

    def describe_model(self) -> str:
        """A line for `memtrain validate`: the model as the planner will see it (built on the meta device),
        after checking that `planning_batch` works."""
        with torch.device("meta"):
            model = self.build_model()
        shape = model_shape(model, self.blocks(model))
        self.planning_batch(1)
        return (
            f"{type(self).__name__}: {shape.numel:,} parameters ({shape.trainable_numel:,} trainable), "
            f"{shape.num_blocks} blocks"
        )

    def choose_plan(self, free_bytes: int | None = None) -> PlanResult:
        """Plan the run (collective on several ranks when the recipe leaves choices open): the planner
        predicts this trainer's job; a recipe that pins every choice gets those strategies, checked.
        `free_bytes` replaces this rank's measured free memory (tests inject uneven headroom)."""
        self.plan_result = make_plan(self.recipe, self.env, self.model_spec(), free_bytes=free_bytes)
        self._plan = self.plan_result.plan
        self.sharding = self._plan.sharding_backend(self.recipe.train.grad_clip)
        return self.plan_result

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            raise MemtrainError("the trainer has no plan yet: call setup() (or choose_plan()) first")
        return self._plan

    @plan.setter
    def plan(self, value: Plan) -> None:
        self._plan = value

    @property
    def _sharding(self) -> ShardingBackend:
        assert self.sharding is not None, "setup() builds the sharding backend"
        return self.sharding

    # ------------------------------------------------------------------------------------ the loop

    @property
    def per_rank_batch_size(self) -> int:
        return self.recipe.batch.global_size // self.env.world_size

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated transformer blocks that strategies wrap (override for unusual layouts)."""
        return discover_blocks(model)

    def setup(self) -> None:
        """Plan (unless `choose_plan()` ran), then build the model and optimizer with every strategy
        applied by `apply_strategies`, in its one fixed order."""
        if self._plan is None:
            self.choose_plan()
        plan, sharding = self.plan, self.sharding
        assert sharding is not None
        seed_everything(self.recipe.run.seed)
        sharding.check(self.env)
        model = self.build_model()
        self._blocks = self.blocks(model)
        applied = apply_strategies(
            model,
            self._blocks,
            plan.precision,
            plan.checkpointing,
            sharding=sharding,
            env=self.env,
            build_optimizer=self.build_optimizer,
            load_weights=self.load_weights,
            adapters=plan.adapters,
            quantization=plan.quantization,
            loss=plan.loss,
            optimizer_step=plan.optimizer_step,
        )
        self.model, self.optimizer, self.scaler = applied.model, applied.optimizer, applied.grad_scaler
        memory = self.recipe.memory
        if memory.track or memory.budget is not None:
            self.tracker = MemoryTracker(
                sharding.unwrap(self.model),
                self.optimizer,
                budget_bytes=int(memory.budget) if memory.budget is not None else None,
                device=self.env.device,
            )
        # What would fail late (an output directory that cannot take a checkpoint, a full disk, a budget
        # below the weights) fails now: rank 0 checks, every rank raises.
        from memtrain.training import preflight

        found = []
        if self.env.is_main:
            found = preflight.run_problems(self.recipe, plan, self.plan_result, sharding.unwrap(self.model))
        preflight.agree(found, self._any_rank(bool(found)))

    def close(self) -> None:
        """Free the model and optimizer, then leave the process group. The order matters under gloo: a
        DDP reducer holds the group, and freeing the reducer after the group has left the registry runs
        the group's destructor while holding the GIL, which deadlocks with a gloo thread that still needs
        the GIL to release the last collective's tensors (pytorch#56297). Freed first, the reducer drops
        its reference while the registry still holds one, and the group is destroyed by
        `destroy_process_group`, which releases the GIL."""
        self.model = None
        self.optimizer = None
        gc.collect()
        shutdown(self.env)

    def fit(self, resume: str | Path | bool | None = None, allow_recipe_change: bool = False) -> FitResult:
        """Train `train.steps` steps. `resume=True` continues from the run's newest checkpoint, a path
        from that checkpoint (or the newest under that directory), "auto" from the newest checkpoint
        if the run has one (else it starts fresh). A checkpoint older than the run's newest truncates
        the run, one of another run forks it (`memtrain.training.lineage`); a resume whose recipe
        changes the training needs `allow_recipe_change`. One process at a time writes a run directory
        (`memtrain.training.run_lock`)."""
        check_loggers(self.recipe.output.loggers)  # a missing package fails before the model is built
        if self.model is None:
            self.setup()
        with self._run_dir_lock():  # before anything in the run directory is written or cleaned
            return self._fit(resume, allow_recipe_change)

    def _fit(self, resume: str | Path | bool | None, allow_recipe_change: bool) -> FitResult:
        output = self.recipe.output
        assert self.model is not None and self.optimizer is not None
        self._recover_run_dir()
        if resume == "auto":
            resume = bool(ckpt.list_checkpoints(self.checkpoint_root))
        start_step = self._restore(resume, allow_recipe_change) if resume else self._fresh_run_dir()
        self._calibrate_until = start_step + CALIBRATION_STEPS
        result = FitResult(run_dir=self.run_dir, plan=self.plan, steps_done=start_step)
        loggers = make_loggers(
            output.loggers, self.run_dir, self.recipe, self.env.is_main, start_step if resume else None
        )
        total = self.recipe.train.steps
        progress = make_progress(output.progress, total, start_step, self.env.is_main)
        progress_line = ProgressLine(
            total,
            output.log_every_s,
            wants_progress_line(output.progress, output.log_every_s, self.env.is_main),
        )
        started = time.perf_counter()
        tokens_seen = 0
        bad_steps = 0
        with contextlib.ExitStack() as cleanup:
            preemption = cleanup.enter_context(PreemptionFlag())
            if self.tracker is not None:
                cleanup.enter_context(self.tracker)
            cleanup.callback(close_loggers, loggers)
            if progress is not None:
                cleanup.callback(progress.close)
            for step in range(start_step, total):
                row = self.train_step(step)
                self._time_step(row, last=step + 1 == total)
                if step < self._calibrate_until:
                    self._calibrate(step, row)
                result.losses.append(row["loss"])
                result.steps_done = step + 1
                tokens_seen += row["tokens"]
                if self._due(step, self.recipe.train.eval_every):
                    row["eval_loss"] = self.evaluate()
                    result.eval_losses[step + 1] = row["eval_loss"]
                if self._due(step, self.recipe.train.log_every) or "eval_loss" in row:
                    log_row(loggers, row)  # rank 0 only: other ranks have no loggers
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
                progress_line.update(row)
                bad_steps = bad_steps + 1 if row["skipped"] else 0
                if bad_steps >= self.recipe.train.max_bad_steps:
                    self.save_checkpoint(step + 1)
                    raise TrainingStopped(
                        f"{bad_steps} steps in a row had non-finite gradients (last loss {row['loss']}); "
                        f"stopped at step {step + 1} with a checkpoint in {self.checkpoint_root}. Lower "
                        "train.lr, use strategies.precision=bf16-mixed, or raise train.max_bad_steps"
                    )
                if self._any_rank(preemption.raised):
                    result.preempted = True
                    interrupted = self._any_rank(preemption.signal_name == "SIGINT")  # Ctrl-C wins
                    result.stopped_by = "SIGINT" if interrupted else "SIGTERM"
                    self.save_checkpoint(step + 1)
                    if self.env.is_main:
                        print(
                            f"[memtrain] {result.stopped_by}: stopped after step {step + 1} with a "
                            "checkpoint; continue with --resume",
                            flush=True,
                        )
                    break
                if self._due(step, self.recipe.checkpoint.every) and step + 1 < total:
                    self.save_checkpoint(step + 1)
            else:
                if self.recipe.checkpoint.at_end and result.steps_done > start_step:
                    self.save_checkpoint(result.steps_done)
        result.summary = self._summary(result, start_step, tokens_seen, time.perf_counter() - started)
        return result

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step over this rank's step batch; returns the metrics row."""
        assert self.model is not None and self.optimizer is not None
        t0 = time.perf_counter()
        self.step_peak.start()
        if self.tracker is not None:
            self.tracker.begin_step(step + 1)
        lr = lr_at(
            step,
            self.recipe.train.lr,
            self.recipe.train.steps,
            self.recipe.train.warmup_steps,
            self.recipe.train.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        totals = self.accumulate_gradients(step)
        grad_norm, skipped = self.optimizer_step()
        loss = float(all_reduce_sum(totals.loss_sum, self.env)) / max(totals.global_tokens, 1)
        elapsed = time.perf_counter() - t0
        row: dict[str, Any] = {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "tokens": totals.global_tokens,
            "tokens_per_s": totals.global_tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
            "grad_norm": grad_norm,
            "skipped": skipped,
            "micro_batches": totals.micro_batches,
            "oom_recoveries": len(self.oom_events),
            "replans": len(self.replans),
            "peak_memory_bytes": self.step_peak.stop(),
        }
        self.max_step_peak = max(self.max_step_peak, row["peak_memory_bytes"])
        if self.tracker is not None:
            report = self.tracker.end_step()
            self.memory_reports.append(report)
            self.device_peaks.append(row["peak_memory_bytes"])
            row["tracked"] = {
                "peak_bytes": report.peak_bytes,
                "at_peak": dict(report.at_peak),
                "peak_phase": report.peak_phase,
                "peak_module": report.peak_module,
            }
        return row

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip and step; a step whose gradients are not finite is skipped (fp16's GradScaler also
        lowers its scale) and counted. Returns (gradient norm before clipping, skipped)."""
        with self._phase("optimizer"):
            return self._clip_and_step()

    def _clip_and_step(self) -> tuple[float, bool]:
        assert self.model is not None and self.optimizer is not None
        stepped = self._sharding.engine_step(self.model)  # DeepSpeed: its engine clips and steps
        if stepped is not None:
            self.skipped_steps += int(stepped[1])
            return stepped
        if isinstance(self.optimizer, InBackwardOptimizer):  # stepped in backward, gradients freed
            norm = self.optimizer.finish_step()
            self.skipped_steps += int(not math.isfinite(norm))
            return norm, not math.isfinite(norm)
        if isinstance(self.optimizer, MasterWeightOptimizer):
            params = self.optimizer.gradients_to_master()
        else:
            params = [p for p in self._sharding.unwrap(self.model).parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.recipe.train.grad_clip
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf))
        skipped = not math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself when it found inf/nan while unscaling
            self.scaler.update()
        elif not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += int(skipped)
        return norm, skipped

    def accumulate_gradients(self, step: int) -> StepTotals:
        """Forward and backward over every micro-batch of `step`, leaving in `.grad` the gradient of the
        mean loss over all loss tokens of the global step batch.

        Out of memory in a micro-step: every rank drops the step's tensors and gradients, the ranks agree,
        the run re-plans (`_recover_from_oom`: more checkpointing, another loss or smaller micro-batches)
        and the *same* step batch is redone. No sample is lost or seen twice, and the gradient is the same
        (the loss is normalised by the global token count). The new plan is kept for the rest of the run;
        its micro-batch size is saved with checkpoints. (On several ranks, an OOM inside the last
        micro-step is the exception: see `_try_accumulate`.)
        """
        batch = self.step_batch(step)
        while True:
            totals = self._try_accumulate(step, batch)
            if totals is not None:
                return totals
            self._recover_from_oom(step)
            self.step_peak.start()  # the step's peak is that of the attempt that completes
            if self.tracker is not None:
                self.tracker.begin_step(step + 1)

    def _try_accumulate(self, step: int, batch: Batch) -> StepTotals | None:
        """One attempt at the step's micro-steps; None when some rank ran out of memory.

        The ranks agree before the last micro-step, the one that synchronises them (DDP all-reduces the
        gradients in its backward), so an OOM in any earlier micro-step is redone by every rank together
        and no rank is left waiting in a collective. An OOM inside the last micro-step on several ranks cannot be agreed on: the peers are
        in (or about to enter) the backend's collectives, which the failed rank can neither join nor
        cancel (answering with the agreement would pair it with a gradient bucket: a collective
        mismatch). That rank stops with a `PlanError` and issues no further collective, and its peers'
        collective fails on the lost peer (or at the collective timeout).
        """
        assert self.model is not None
        micro_batches = [self._to_device(mb) for mb in self.split_batch(batch, self.plan.micro_batch_size)]
        counts = [self.count_tokens(mb) for mb in micro_batches]
        global_tokens = int(all_reduce_sum(torch.tensor(sum(counts), dtype=torch.long), self.env))
        scale = self._sharding.grad_sync_scale(self.env) / max(global_tokens, 1)
        loss_total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        self.model.train()
        failed = False
        for index, micro_batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            if last and self._any_rank(failed):
                return None
            if failed:
                continue
            try:
                loss_total += self._micro_step(micro_batch, scale, last, counts[index] if step == 0 else None)
            except torch.OutOfMemoryError as exc:
                self.oom_events.append(
                    {
                        "step": step + 1,
                        "micro_step": index + 1,
                        "micro_batch_size": self.plan.micro_batch_size,
                        "error": str(exc)[:200],
                    }
                )
                if last and self.env.distributed:
                    raise self._unagreeable_oom(step) from None
                failed = True
        if failed:
            return None
        return StepTotals(loss_sum=loss_total, global_tokens=global_tokens, micro_batches=len(micro_batches))

    def _micro_step(
        self, micro_batch: Batch, scale: float, last: bool, expected_tokens: int | None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed loss (detached, float64). Its
        tensors live only in this frame, so an exception here releases them."""
        assert self.model is not None
        with self._sharding.micro_step(self.model, last):
            with self._phase("forward"), self.plan.precision.autocast(self.env.device):
                loss_sum, num_tokens = self.loss(self.model, micro_batch)
            if expected_tokens is not None:
                self._check_token_count(num_tokens, expected_tokens)
            with self._phase("backward"):
                scaled = loss_sum * scale
                self._sharding.backward(
                    self.model, self.scaler.scale(scaled) if self.scaler is not None else scaled
                )
        return loss_sum.detach().double()

    def _unagreeable_oom(self, step: int) -> PlanError:
        tokens = self.plan.micro_batch_tokens
        smaller = (
            f"a smaller batch.micro_tokens (it was {tokens})"
            if tokens is not None
            else f"a smaller batch.micro_size (it was {self.plan.micro_batch_size})"
        )
        return PlanError(
            f"out of memory on rank {self.env.rank} in the last micro-step of step {step + 1}, while the other "
            "ranks were synchronising it: the ranks cannot agree to redo this step (only an earlier micro-step "
            f"can be redone). Continue with --resume and {smaller}"
        )

    def _any_rank(self, flag: bool) -> bool:
        if not self.env.distributed:
            return flag
        return bool(all_reduce_sum(torch.tensor(int(flag), device=self.env.device), self.env) > 0)

    def _calibrate(self, step: int, row: dict[str, Any]) -> None:
        """Compare a first step's measured memory with the plan's prediction, record it in plan.json,
        and re-plan (`_recover_from_oom`) when the measured peak passed the usable budget.

        The measurement is the tracker's report when it runs (all components), else the allocator's
        peak on CUDA; on a CPU without the tracker, RSS is no per-tensor figure and only the budget
        check is skipped."""
        result = self.plan_result
        assert result is not None
        report = self.memory_reports[-1] if self.tracker is not None and self.memory_reports else None
        if report is not None:
            entry = calibration(result, report)
            measured_peak: int | None = report.peak_bytes
        else:
            predicted = result.predicted
            measured_peak = row["peak_memory_bytes"] if self.env.device.type == "cuda" else None
            entry = {
                "predicted": predicted.to_dict() if predicted is not None else None,
                "measured": {"peak": measured_peak} if measured_peak is not None else None,
            }
        self.calibration.append({"step": step + 1, **entry})
        budget = result.budget
        over = budget is not None and measured_peak is not None and measured_peak > budget.usable
        if self.env.is_main:
            self._write_plan_json()
        if self._any_rank(over):
            self._recover_from_oom(
                step,
                reason=f"measured peak {format_bytes(measured_peak or 0)} passed the "
                f"usable {format_bytes(budget.usable if budget else 0)}",
                measured=report if report is not None else measured_peak,
            )

    def _time_step(self, row: dict[str, Any], last: bool) -> None:
        """Rank 0: time the plan's first steps after its first (lazy optimizer state, warm-up);
        after `STEP_TIME_STEPS` of them, or at the end of a shorter run, compare their median with the
        predicted step time: a log line, `step_time` in plan.json and summary.json, and a re-fit of this
        machine's step-time model when more than 10% off (planner/step_time_calibration.py). A plan
        switched to (re-plan, out-of-memory recovery) is timed afresh."""
        result = self.plan_result
        if not self.env.is_main or self.step_time is not None or result is None or result.chosen is None:
            return
        if result is not self._timed_plan:  # the first step of this plan, or one a new plan took over
            self._timed_plan, self._step_times = result, []
        else:
            self._step_times.append(row["step_time_s"])
        if self._step_times and (len(self._step_times) >= STEP_TIME_STEPS or last):
            self.step_time = step_time_calibration.check_step_time(
                result.chosen.cost, self._step_times, self.env.device, self.plan.describe()
            )
            # stderr, with the planner's progress: `memtrain profile --json` keeps stdout for its report
            print(step_time_calibration.describe(self.step_time), file=sys.stderr, flush=True)
            self._write_plan_json()

    def _write_plan_json(self) -> None:
        result = self.plan_result
        assert result is not None
        self._write_json(
            self.run_dir / "plan.json",
            {
                "plan": self.plan.to_dict(),
                "summary": self.plan.summary(),
                "predicted": result.predicted.to_dict() if result.predicted is not None else None,
                "budget": result.budget.to_dict() if result.budget is not None else None,
                "calibration": self.calibration,
                "step_time": self.step_time,
                "replans": self.replans,
            },
        )

    def _recover_from_oom(
        self, step: int, reason: str = "out of memory", measured: StepMemory | int | None = None
    ) -> None:
        """Drop the failed attempt's gradients and cached blocks, then re-plan (training/replan.py): the
        excess `measured` shows over the prediction (None: an out-of-memory error) corrects every
        candidate, and the fastest plan the live model can switch to that fits replaces this one. A
        pinned plan (nothing predicted) only shrinks its micro-batch."""
        assert self.model is not None and self.optimizer is not None
        if isinstance(self.optimizer, InBackwardOptimizer):
            self.optimizer.check_redoable(step)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._sharding.discard_step(self.model)
        gc.collect()
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()
        result = self.plan_result
        if result is None or result.chosen is None or result.budget is None:
            self.plan, line = replan.smaller_micro_batch(self.plan, step, reason)
        else:
            excess = replan.excess(result.chosen.prediction.at_peak, measured, result.budget)
            self.correction = replan.agree(self.correction.then(excess), self.env)
            done = replan.replan(
                self.recipe,
                self.env,
                self.model_spec(),
                result,
                self.plan,
                self.correction,
                step,
                reason,
                self.tracker,
            )
            new = done.result.plan
            switch_in_place(self._sharding.unwrap(self.model), self._blocks, new.checkpointing, new.loss)
            self.plan, self.plan_result, line = new, done.result, done.line
            self.replans.append(done.record)
            if self.oom_events and measured is None:
                self.oom_events[-1]["replanned_to"] = done.record["to"]
            # the new plan's first steps are compared with its (corrected) prediction too
            self._calibrate_until = step + 1 + CALIBRATION_STEPS
            if self.env.is_main:
                self._write_plan_json()
        if self.env.is_main:
            print(line + ("; redoing the same batch" if measured is None else ""), flush=True)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean loss over `eval_batches()` on every rank, combined over ranks."""
        assert self.model is not None
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for batch in self.eval_batches():
            for micro_batch in self.split_batch(self._to_device(batch), self.plan.micro_batch_size):
                with self.plan.precision.autocast(self.env.device):
                    loss_sum, num_tokens = self.loss(self._sharding.unwrap(self.model), micro_batch)
                totals[0] += loss_sum.double()
                totals[1] += float(num_tokens)
        self.model.train()
        totals = all_reduce_sum(totals, self.env)
        return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")

    # ------------------------------------------------------------------------------------ checkpoints

    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self, step: int) -> Path:
        """Atomically save everything needed to continue exactly after `step` steps. A full disk (or
        quota) on any rank is the same one-line `DiskFullError` on every rank: the staging directory is
        removed and the previous checkpoint stays."""
        assert self.model is not None and self.optimizer is not None
        root = self.checkpoint_root
        staging = ckpt.staging_dir(root, step)
        if self.env.is_main:
            ckpt.begin_save(root, step)
        barrier(self.env)
        self._save_agreed(step, lambda: self._write_checkpoint_files(staging))
        self._save_agreed(step, lambda: self._commit_checkpoint(step) if self.env.is_main else None)
        return root / ckpt.step_dir_name(step)

    def _write_checkpoint_files(self, staging: Path) -> None:
        assert self.model is not None and self.optimizer is not None
        self._sharding.save(staging, self.model, self.optimizer, self.env)
        if self.env.is_main and self.scaler is not None:
            ckpt.save_tensor_file(staging / "grad_scaler.pt", self.scaler.state_dict())
        ckpt.save_tensor_file(staging / f"rng_rank{self.env.rank}.pt", ckpt.rng_state())

    def _commit_checkpoint(self, step: int) -> None:
        segment = self.segment
        recipe = self.recipe.to_dict()
        meta = {
            "step": step,
            "world_size": self.env.world_size,
            "plan": self.plan.to_dict(),
            "recipe_fingerprint": self.recipe.fingerprint(),
            "recipe": recipe,  # what a resume compares its recipe with (lineage.check_recipe)
            "lineage": segment.lineage if segment is not None else None,
            "parent": segment.parent if segment is not None else None,
            "skipped_steps": self.skipped_steps,
            "model_section": recipe["model"],
            "saved_at": time.time(),
        }
        ckpt.commit_save(self.checkpoint_root, step, meta, self.recipe.checkpoint.keep)

    def _save_agreed(self, step: int, write: Callable[[], None]) -> None:
        """Run one part of a save, then agree with the other ranks (this is the save's barrier), so that a
        full disk on one rank stops every rank with the same error instead of leaving them waiting."""
        full = False
        try:
            write()
        except Exception as exc:
            if not ckpt.is_disk_full(exc):
                raise
            full = True
        if self._any_rank(full):
            if self.env.is_main:
                ckpt.abort_save(self.checkpoint_root, step)
            raise ckpt.disk_full_error(self.checkpoint_root, step) from None

    def _restore(self, resume: str | Path | bool, allow_recipe_change: bool = False) -> int:
        """Load the checkpoint to resume from; with `checkpoint.fallback`, an unreadable newest checkpoint
        falls back to the previous one (the error names each file that failed). The ranks agree on each
        candidate, so a file only one rank reads (its RNG state) moves them all to the same checkpoint.
        Then the run's lineage goes on from the checkpoint loaded (`_continue_lineage`)."""
        location = self.checkpoint_root if resume is True else Path(str(resume))
        found = ckpt.find_checkpoint(location)
        event = self._resume_event(found)
        candidates = [found]
        if self.recipe.checkpoint.fallback and found.path.parent == location:
            candidates += [c for c in reversed(ckpt.list_checkpoints(location)) if c.step < found.step]
        for index, candidate in enumerate(candidates):
            try:
                step, problem = self._load_checkpoint(candidate, allow_recipe_change), None
            except ckpt.CheckpointError as exc:
                step, problem = -1, str(exc)
            if not self._any_rank(problem is not None):
                self._continue_lineage(event, candidate)
                return step
            problem = problem or f"{candidate.path}: another rank could not load it (see its error)"
            if index + 1 == len(candidates):
                raise ckpt.CheckpointError(problem)
            if self.env.is_main:
                print(f"[memtrain] {problem}; falling back to {candidates[index + 1].path}", flush=True)
        raise AssertionError("unreachable")

    def _resume_event(self, found: ckpt.Checkpoint) -> str:
        """'resume' from this run's newest checkpoint, 'truncate' from an older one of this run, 'fork'
        from another run's (this run must hold no checkpoint then)."""
        own = ckpt.list_checkpoints(self.checkpoint_root)
        if found.path.parent.resolve() == self.checkpoint_root.resolve():
            return "truncate" if found.step < own[-1].step else "resume"
        if own:
            raise ckpt.CheckpointError(
                f"{found.path} belongs to another run: resuming from it forks that run into run.output_dir "
                f"{self.run_dir}, which already holds checkpoints (newest: step {own[-1].step}); set "
                "run.output_dir to a new directory, or resume from a checkpoint of this run"
            )
        return "fork"

    def _load_checkpoint(self, found: ckpt.Checkpoint, allow_recipe_change: bool = False) -> int:
        """Load `found` into the run; the plan changes only once every file has loaded. A recipe that
        changes the training is refused first (`lineage.check_recipe`) unless `allow_recipe_change`."""
        assert self.model is not None and self.optimizer is not None
        meta = found.meta
        current = self.recipe.to_dict()
        if meta.get("model_section") != current["model"]:
            raise ckpt.CheckpointError(
                f"{found.path / 'meta.json'}: saved for a different model section; resume with the same "
                "model: settings or start a new run.output_dir"
            )
        if found.step > self.recipe.train.steps:
            raise ckpt.CheckpointError(
                f"{found.path}: is at step {found.step}, past train.steps={self.recipe.train.steps}"
            )
        if not allow_recipe_change:
            unfinished = lineage.unfinished_segment(self.run_dir, found, meta)
            lineage.check_recipe(found, meta, current, unfinished["recipe"] if unfinished else None)
        optimizer_file = found.path / "optimizer.pt"
        try:
            self._sharding.load(found.path, self.model, self.optimizer, self.env)
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # e.g. another optimizer's state
            where = optimizer_file if optimizer_file.is_file() else found.path
            raise ckpt.CheckpointError(
                f"{where}: does not fit this run ({type(exc).__name__}: {exc})"
            ) from None
        if optimizer_file.is_file() and self.plan.sharding.replicated:
            self._check_optimizer_shapes(optimizer_file)
        if self.scaler is not None:
            self.scaler.load_state_dict(ckpt.load_tensor_file(found.path / "grad_scaler.pt"))
        rng_file = found.path / f"rng_rank{self.env.rank}.pt"
        ckpt.load_rng_state(rng_file if rng_file.is_file() else found.path / "rng_rank0.pt")
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self._adopt_saved_micro_batch(meta.get("plan", {}))
        if self.env.is_main:
            print(f"[memtrain] resumed from {found.path} at step {found.step}", flush=True)
        return found.step

    def _check_optimizer_shapes(self, file: Path) -> None:
        """Another model's optimizer.pt loads without complaint (same number of tensors) and would fail,
        or broadcast silently, in the first step: each state tensor must have its parameter's shape."""
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for name, value in self.optimizer.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                        raise ckpt.CheckpointError(
                            f"{file}: optimizer state {name!r} has shape {tuple(value.shape)} for a parameter of "
                            f"shape {tuple(param.shape)} (written for another model)"
                        )

    def _adopt_saved_micro_batch(self, saved: dict[str, Any]) -> None:
        """Keep micro-batches that an out-of-memory recovery made smaller before the checkpoint."""
        try:
            micro = Plan.from_dict(saved).micro_batching
        except ValueError:
            return  # an older layout of plan metadata: keep this run's plan
        current = self.plan.micro_batching
        if (
            saved.get("world_size") == self.env.world_size
            and type(micro) is type(current)
            and micro.rows == current.rows
            and micro.tokens(1) < current.tokens(1)
        ):
            self.plan = self.plan.replace(micro_batching=micro)

    def _continue_lineage(self, event: str, loaded: ckpt.Checkpoint) -> None:
        """Rank 0 (which alone writes meta.json): start this segment of the run's lineage
        (`memtrain.training.lineage`) from the checkpoint just loaded, and record it. Its lineage id is a
        new one unless it resumes the newest checkpoint's, or continues a segment that started from the
        same checkpoint and died before saving."""
        if not self.env.is_main:
            return
        meta = loaded.meta
        unfinished = lineage.unfinished_segment(self.run_dir, loaded, meta) if event != "truncate" else None
        if unfinished is not None:
            lineage_id = str(unfinished["lineage"])
        elif event == "resume" and meta.get("lineage"):
            lineage_id = str(meta["lineage"])
        else:
            lineage_id = lineage.new_lineage_id()
        self.segment = lineage.Segment(lineage_id, lineage.parent_of(loaded, meta))
        if event == "fork":
            self._write_run_files()
        lineage.record_segment(self.run_dir, event, self.segment, loaded, self.recipe.to_dict(), unfinished)

    def _fresh_run_dir(self) -> int:
        existing = ckpt.list_checkpoints(self.checkpoint_root)
        if existing:
            raise ckpt.CheckpointError(
                f"{self.run_dir} already holds checkpoints (newest: step {existing[-1].step}); "
                "pass --resume to continue it, or set run.output_dir to a new directory"
            )
        if self.env.is_main:
            self.segment = lineage.Segment(lineage.new_lineage_id(), None)
            self._write_run_files()
            start = {"event": "start", "lineage": self.segment.lineage, "parent": None}
            lineage.append_record(self.run_dir, {**start, "recipe": self.recipe.to_dict()})
        barrier(self.env)
        return 0

    def _write_run_files(self) -> None:
        """recipe.json and plan.json of a run that starts here (fresh, or forked from another run)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._write_json(self.run_dir / "recipe.json", self.recipe.to_dict())
        self._write_plan_json()

    @contextlib.contextmanager
    def _run_dir_lock(self) -> Iterator[None]:
        """Rank 0 holds the run directory's lock (`run_lock`) while the body runs; the ranks agree on
        whether it got it, so every rank stops with the same error and none waits in a collective."""
        held: run_lock.RunLock | None = None
        in_use: run_lock.RunDirInUse | None = None
        if self.env.is_main:
            try:
                held = run_lock.acquire(self.run_dir)
            except run_lock.RunDirInUse as exc:
                in_use = exc
        if self._any_rank(in_use is not None):
            raise in_use or run_lock.in_use_error(self.run_dir)
        try:
            yield
        finally:
            if held is not None:
                held.release()

    def _recover_run_dir(self) -> None:
        """Rank 0, under the lock, before any rank lists checkpoints: put back a checkpoint a crash left
        renamed aside, remove stale staging directories, finish a truncation a crash interrupted."""
        if self.env.is_main:
            ckpt.recover(self.checkpoint_root)
            lineage.finish_truncation(self.run_dir)
        barrier(self.env)

    # ------------------------------------------------------------------------------------ helpers

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.tracker.phase(name) if self.tracker is not None else contextlib.nullcontext()

    @staticmethod
    def _due(step: int, every: int) -> bool:
        return every > 0 and (step + 1) % every == 0

    @staticmethod
    def _check_token_count(reported: int | torch.Tensor, counted: int) -> None:
        if int(reported) != counted:
            raise MemtrainError(
                f"loss() reported {int(reported)} tokens but count_tokens() counted {counted}; "
                "override Trainer.count_tokens so the two agree (the loss must be a sum over these tokens)"
            )

    @staticmethod
    def _write_json(path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json_out.dumps(data, indent=2, sort_keys=True))
        tmp.replace(path)

    def _summary(self, result: FitResult, start: int, tokens: int, seconds: float) -> dict[str, Any]:
        summary = {
            "steps": result.steps_done,
            "steps_this_run": result.steps_done - start,
            "first_loss": result.losses[0] if result.losses else None,
            "final_loss": result.losses[-1] if result.losses else None,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "seconds": seconds,
            "peak_memory_bytes": self.max_step_peak,
            "skipped_steps": self.skipped_steps,
            "step_time": self.step_time,
            "plan": self.plan.to_dict(),
            "run_dir": str(self.run_dir),
        }
        if self.env.is_main:
            self._write_json(self.run_dir / "summary.json", summary)
        return summary


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def describe_summary(summary: dict[str, Any]) -> str:
    first, final = summary["first_loss"], summary["final_loss"]
    losses = f"loss {first:.4f} -> {final:.4f}" if first is not None else "no step run"
    return (
        f"[memtrain] {summary['steps']} steps ({summary['steps_this_run']} this run), {losses}, "
        f"{summary['tokens_per_s']:.0f} tokens/s, peak {format_bytes(summary['peak_memory_bytes'])}, "
        f"{summary['seconds']:.1f} s; outputs in {summary['run_dir']}"
    )
