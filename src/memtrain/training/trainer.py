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
    tensor_parallel_plan(model)       -> module name -> ParallelStyle (default None: no tensor parallel)
    expert_parallel_plan(model)       -> its MoE experts modules (default None: no expert parallel)
    pipeline_split(model, s, p)       -> keep stage s of p in place; the trailing shape of what it hands
                                         stage s + 1 (default None: pp > 1 refused)
    loss(model, micro_batch)          -> (loss_sum, num_tokens)
    count_tokens(micro_batch)         -> int                     (default: labels != -100)
    split_batch(batch, micro_size)    -> list of micro-batches   (default: slices along dim 0)
    context_parallel_split(mb)        -> this rank's columns under strategies.mesh.cp > 1 (default: by columns)
    eval_batches()                    -> iterable of batches     (default: none)
    blocks(model)                     -> the repeated blocks strategies wrap (default: discovered)

The planner predicts the job these hooks describe (`model_spec()`): it calls `build_model` on the meta
device and under fake tensors, `loss` on micro-batches shaped like `planning_batch(rows)` (default: rows
of `step_batch(0)`), and counts `host_data_bytes()`. Planning happens in `setup()` (or an explicit
`choose_plan()`), once the subclass is fully constructed.

Beside the loop: the run directory (`memtrain.run.RunDirectory`: lock, checkpoints, lineage, the run's
files), the memory monitor (`memory_monitor`: measurement, calibration, re-planning), `trainer_state`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys
import time
from collections.abc import Iterable, Set
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from memtrain.distributed import DistEnv, any_rank, data_parallel_sum, init_distributed, shutdown
from memtrain.errors import MemtrainError, TrainingStopped
from memtrain.plan import Plan, arranged
from memtrain.planner import ModelSpec, PlanResult, choose_mesh, make_plan, stderr_progress
from memtrain.planner.spec import loss_output
from memtrain.recipe import Recipe
from memtrain.run import Resume, RunDirectory
from memtrain.run.checkpoints import Checkpoint
from memtrain.schedules import due, lr_at
from memtrain.strategies.apply import switch_in_place
from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.context_parallel import parallel_loss, rank_share
from memtrain.strategies.expert_parallel import ExpertLayer, routing_row
from memtrain.strategies.master_weights import MasterWeightOptimizer
from memtrain.strategies.optimizer_step import InBackwardOptimizer
from memtrain.strategies.pipeline import PipelineSplit, is_pipeline, run_step, stage_group
from memtrain.strategies.sharding.base import ShardingBackend
from memtrain.strategies.tensor_parallel import TensorParallelPlan, clip_grad_norm
from memtrain.training import evaluation, loggers, preemption, preflight, trainer_state, two_pass
from memtrain.training.applying import apply_plan
from memtrain.training.batch_rows import checked_batch, row_count, row_lengths, split_rows
from memtrain.training.class_reference import class_reference
from memtrain.training.memory_monitor import MemoryMonitor, OverBudget
from memtrain.training.results import FitResult, StepTotals, check_token_count, seed_everything, summary_of

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100


class Trainer:
    """Subclass and override the hooks; call `fit()`.

    `recipe_class` is the trainer's recipe: `Recipe`, or a subclass with the trainer's own sections
    (`MyTrainer.recipe_class.load("my.yaml")` reads one; the command line reads with it)."""

    recipe_class: ClassVar[type[Recipe]] = Recipe
    pipeline_split: PipelineSplit | None = None  # keeps a stage's part of the model for pp > 1 (causal LM)

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = self.recipe_class.adopt(recipe)
        self.env: DistEnv = init_distributed()  # arranged into `strategies.mesh` by `choose_plan`
        self.run = RunDirectory(self.recipe.output_path(), self.env)
        self.monitor = MemoryMonitor(self.env, self.run)
        self._plan: Plan | None = None
        self.sharding: ShardingBackend | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.skipped_steps = 0
        self.empty_steps = 0  # of those, steps without a loss token (this process's count)
        self._blocks: list[nn.Module] = []  # the blocks strategies wrapped (a re-plan re-wraps them)
        self.early_stopping = evaluation.EarlyStopping(self.recipe.train.early_stopping)

    @property
    def run_dir(self) -> Path:
        return self.run.path

    @property
    def plan_result(self) -> PlanResult | None:
        """The planner's result for the plan in use (set by `choose_plan`, replaced by a re-plan)."""
        return self.monitor.plan_result

    @plan_result.setter
    def plan_result(self, value: PlanResult | None) -> None:
        self.monitor.plan_result = value

    @classmethod
    def recipe_problems(cls, recipe: Recipe, skip: Set[str] = frozenset()) -> list[str]:
        """Problems in the trainer's own recipe part found before anything is built or written (one line
        each, naming its key), for `memtrain validate` and the recipe's one pass of errors; sections in
        `skip` failed validation and stand at their defaults. Default: none."""
        return []

    # ------------------------------------------------------------------------------------ hooks

    def build_model(self) -> nn.Module:
        raise MemtrainError(f"{type(self).__name__}: implement build_model() (subclass memtrain.Trainer)")

    def build_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The plan's optimizer (`optimizer.name`; AdamW's states as `optimizer_states` says) with `train:`
        settings over the trainable parameters."""
        t = self.recipe.train
        return self.plan.optimizer.build(
            params, self.plan.stepped_states, lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
        )

    def step_batch(self, step: int) -> Batch:
        raise MemtrainError(f"{type(self).__name__}: implement step_batch(step) (subclass memtrain.Trainer)")

    def tensor_parallel_plan(self, model: nn.Module) -> TensorParallelPlan | None:
        """Module name -> torch `ParallelStyle` for `strategies.mesh.tp > 1` (None: tp > 1 is refused)."""
        return None

    def expert_parallel_plan(self, model: nn.Module) -> list[ExpertLayer] | None:
        return None  # each MoE layer's experts for strategies.mesh.ep > 1 (strategies.expert_parallel)

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int | torch.Tensor]:
        raise MemtrainError(
            f"{type(self).__name__}: implement loss(model, batch) -> (loss_sum, num_tokens) (subclass memtrain.Trainer)"
        )

    def count_tokens(self, batch: Batch) -> int:
        if "labels" not in batch:
            raise MemtrainError("count_tokens: the batch has no 'labels'; override Trainer.count_tokens")
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def split_batch(self, batch: Batch, micro_size: int) -> list[Batch]:
        """Slices of `micro_size` rows, or the row groups of the plan's micro-batching (a token budget); tensors
        without the row dimension go whole into each (`batch_rows`)."""
        return split_rows(batch, micro_size, self.plan.micro_batching.split(batch, self.row_tokens))

    def context_parallel_split(self, batch: Batch) -> Batch:
        """This rank's tokens under `strategies.mesh.cp > 1` (`rank_share`; `loss` must pass `position_ids`)."""
        return rank_share(batch, self.env)

    def row_tokens(self, batch: Batch) -> list[int]:
        """Each row's length up to its last loss token (what a micro-batch pads to)."""
        return row_lengths(batch, IGNORE_INDEX)

    def eval_batches(self) -> Iterable[Batch]:
        return []

    # ------------------------------------------------------------------------------------ planning

    def planning_batch(self, rows: int) -> Batch:
        """A micro-batch of `rows` rows shaped like the largest this trainer feeds: by default the rows of
        `step_batch(0)`, repeated or cut to `rows` (tensors without a row dimension are kept as they are).
        Override when later steps carry longer rows than step 0."""
        batch = checked_batch(self.step_batch(0), type(self).__name__)
        count = row_count(batch)
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
        overridden = type(self).build_model_clone is not Trainer.build_model_clone
        where = class_reference(type(self))
        return ModelSpec(
            build_model=self.build_model,
            blocks=self.blocks,
            micro_batch=self.planning_batch,
            loss=self.loss,
            build_clone=self.build_model_clone if overridden else None,  # type: ignore[arg-type]
            host_bytes=self.host_data_bytes,
            name=f"{type(self).__name__}.build_model()",
            pipeline=self.pipeline_split is not None,
            rebuild=None if where is None else (where, self.recipe.to_dict()),
        )

    def choose_plan(self, free_bytes: int | None = None) -> PlanResult:
        """Plan the run (collective on several ranks when the recipe leaves choices open): the planner
        predicts this trainer's job; a recipe that pins every choice gets those strategies, checked.
        `free_bytes` replaces this rank's measured free memory (tests inject uneven headroom). The ranks are
        arranged into the recipe's mesh here, where the plan needs it (`memtrain plan --world-size N` builds
        the trainer on one process for a mesh of N)."""
        progress = preemption.interruptible(stderr_progress, self.env)  # a signal stops it between traces
        chosen = choose_mesh(self.recipe, self.env, self.model_spec(), progress=progress)  # open degrees
        self.env = self.monitor.env = arranged(self.env, self.recipe, chosen)
        self.plan_result = make_plan(
            self.recipe, self.env, self.model_spec(), free_bytes=free_bytes, progress=progress
        )
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

    # ------------------------------------------------------------------------------------ setup

    @property
    def per_rank_batch_size(self) -> int:
        return self.recipe.batch.global_size // self.env.dp_size

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated transformer blocks that strategies wrap (override for unusual layouts)."""
        return discover_blocks(model)

    def setup(self) -> None:
        """Plan (unless `choose_plan()` ran), then build the model and optimizer with every strategy
        applied by `apply_strategies`, in its one fixed order. A signal meanwhile stops it at the end
        (`preemption`: KeyboardInterrupt or SignalStop on every rank)."""
        with preemption.watching(self.recipe.train.stop_signals) as stop:
            self._setup()
            preemption.stop_before_training(stop, self.env)

    def _setup(self) -> None:
        if self._plan is None:
            self.choose_plan()
        plan, sharding = self.plan, self._sharding
        seed_everything(self.recipe.run.seed)
        sharding.check(self.env)
        self.env = self.monitor.measure_links(self.recipe.planner.measure_links)  # builds the DeviceMesh
        applied, self._blocks = apply_plan(self, self.build_model())
        self.model, self.optimizer, self.scaler = applied.model, applied.optimizer, applied.grad_scaler
        self.monitor.track(sharding.unwrap(self.model), self.optimizer, self.recipe.memory)
        # What would fail late (no room for a checkpoint, a budget below the weights): rank 0 checks, all raise.
        found = []
        if self.env.is_main:
            found = preflight.run_problems(self.recipe, plan, self.plan_result, sharding.unwrap(self.model))
        preflight.agree(found, any_rank(bool(found), self.env))

    def close(self) -> None:
        """Free the model and optimizer, then leave the process group: a DDP reducer freed after its group left
        the registry destroys the group holding the GIL, deadlocking gloo's thread (pytorch#56297)."""
        self.model = None
        self.optimizer = None
        gc.collect()
        shutdown(self.env)

    # ------------------------------------------------------------------------------------ the loop

    def fit(self, resume: Resume = None, allow_recipe_change: bool = False) -> FitResult:
        """Train `train.steps` steps. `resume=True` continues from the run's newest checkpoint, a path
        from that checkpoint (or the newest under that directory), "auto" from the newest checkpoint
        if the run has one (else it starts fresh). A checkpoint older than the run's newest truncates
        the run, one of another run forks it (`memtrain.run.lineage`); a resume whose recipe changes
        the training needs `allow_recipe_change`. One process at a time writes a run directory
        (`RunDirectory.locked`)."""
        loggers.check_loggers(self.recipe.output.loggers)  # a missing package fails before the model is built
        with preemption.watching(self.recipe.train.stop_signals) as stop:
            if self.model is None:
                self.setup()
            with self.run.locked():  # before anything in the run directory is written or cleaned
                resume = self.run.wants_resume(resume)
                start = self._restore(resume, allow_recipe_change) if resume else self._start_fresh()
                self.monitor.start_at(start)
                result = FitResult(run_dir=self.run_dir, plan=self.plan, steps_done=start)
                started = time.perf_counter()
                with contextlib.ExitStack() as cleanup:
                    self._train_steps(result, start, bool(resume), cleanup)
                seconds, skipped = time.perf_counter() - started, (self.skipped_steps, self.empty_steps)
                result.summary = summary_of(result, self.plan, start, seconds, self.monitor, skipped)
                if self.env.is_main:
                    self.run.write_summary(result.summary)
            late = preemption.agreed_signal(stop, self.env)  # one during the last checkpoint: its exit code
            result.stopped_by = late or result.stopped_by
            return result

    def _train_steps(
        self, result: FitResult, start: int, resumed: bool, cleanup: contextlib.ExitStack
    ) -> None:
        """The steps from `start` to `train.steps`, their logging, and the checkpoints along the way;
        `cleanup` closes what they open (loggers, the progress bar, the tracker); a signal stops it."""
        total = self.recipe.train.steps
        stop = cleanup.enter_context(preemption.watching(self.recipe.train.stop_signals))  # fit's flag
        preemption.stop_before_training(stop, self.env)
        if self.monitor.tracker is not None:
            cleanup.enter_context(self.monitor.tracker)
        resume_step = start if resumed else None
        report = cleanup.enter_context(
            loggers.StepReport(self.recipe, self.run_dir, self.env.is_main, start, resume_step)
        )
        bad_steps = 0
        for step in range(start, total if not evaluation.stopped_before(self, start) else start):
            row = self._step_and_record(step, result)
            report.add(row)  # rank 0 only: other ranks have no loggers
            if row["tokens"]:  # a step without a loss token neither counts as bad nor ends a bad run
                bad_steps = bad_steps + 1 if row["skipped"] else 0
            self._stop_on_bad_steps(step, bad_steps, row)
            if self._stop_on_signal(step, stop, result) or evaluation.stop_early(
                self, step, result, self.save_checkpoint
            ):
                return
            if due(step, self.recipe.checkpoint.every) and step + 1 < total:
                self.save_checkpoint(step + 1)
        if self.recipe.checkpoint.at_end and result.steps_done > start:
            self.save_checkpoint(result.steps_done)

    def _step_and_record(self, step: int, result: FitResult) -> dict[str, Any]:
        """Train step `step`, let the monitor check it (and re-plan when it passed the budget), evaluate
        when due; the step's metrics row."""
        row = self.train_step(step)
        last = step + 1 == self.recipe.train.steps
        over = self.monitor.after_step(step, row, self.plan, last) if row["tokens"] else None  # empty: none
        if over is not None:
            self._recover_from_oom(step, over)
        result.losses.append(row["loss"])
        result.steps_done = step + 1
        result.tokens_seen += row["tokens"]
        if due(step, self.recipe.train.eval_every):
            evaluation.record(self, step, row, result)
        return row

    def _stop_on_bad_steps(self, step: int, bad_steps: int, row: dict[str, Any]) -> None:
        if bad_steps < self.recipe.train.max_bad_steps:
            return
        self.save_checkpoint(step + 1)
        raise TrainingStopped(
            f"{bad_steps} steps in a row had non-finite gradients (last loss {row['loss']}); "
            f"stopped at step {step + 1} with a checkpoint in {self.run.layout.checkpoints}. Lower "
            "train.lr, use strategies.precision=bf16-mixed, or raise train.max_bad_steps"
        )

    def _stop_on_signal(self, step: int, stop: preemption.PreemptionFlag, result: FitResult) -> bool:
        """After a stop signal or Ctrl-C on any rank: a checkpoint of this step, and True (stop)."""
        stopped_by = preemption.agreed_signal(stop, self.env)
        if stopped_by is None:
            return False
        result.preempted, result.stopped_by = True, stopped_by
        self.save_checkpoint(step + 1)
        preemption.announce(stopped_by, step + 1, self.env)
        return True

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step over this rank's step batch; returns the metrics row."""
        assert self.model is not None and self.optimizer is not None
        t0 = time.perf_counter()
        self.monitor.begin_step(step)
        lr = lr_at(step, self.recipe.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        totals = two_pass.accumulate(self, step)  # twice when clipping with the step in backward
        empty = not totals.global_tokens  # on every rank: the count is all-reduced
        grad_norm, skipped = self._skip_empty_step(step) if empty else self.optimizer_step()
        loss_sum = float(data_parallel_sum(totals.loss_sum, self.env))
        loss = math.nan if empty else loss_sum / totals.global_tokens
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
            **routing_row(self.env),  # expert parallel: rows each rank received, each layer's max/mean load
        }
        self.monitor.end_step(row)
        return row

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip and step; a step whose gradients are not finite is skipped (fp16's GradScaler also
        lowers its scale) and counted. Returns (gradient norm before clipping, skipped)."""
        with self.monitor.phase("optimizer"):
            norm, skipped = self._clip_and_step()
        self.skipped_steps += int(skipped)
        return norm, skipped

    def _skip_empty_step(self, step: int) -> tuple[float, bool]:
        """A step without a loss token: not run, no optimizer step (decay and moments would move), counted."""
        self.skipped_steps, self.empty_steps = self.skipped_steps + 1, self.empty_steps + 1
        if self.env.is_main:
            print(f"[memtrain] step {step + 1}: no loss tokens in the batch; skipped", file=sys.stderr)
        return 0.0, True

    def _clip_and_step(self) -> tuple[float, bool]:
        assert self.model is not None and self.optimizer is not None
        stepped = self._sharding.engine_step(self.model)  # DeepSpeed: its engine clips and steps
        if stepped is not None:
            return stepped
        if isinstance(self.optimizer, InBackwardOptimizer):  # stepped in backward, gradients freed
            norm = self.optimizer.finish_step()
            return norm, not math.isfinite(norm)
        if isinstance(self.optimizer, MasterWeightOptimizer):
            params = self.optimizer.gradients_to_master()
        else:
            params = [p for p in self._sharding.unwrap(self.model).parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.recipe.train.grad_clip
        norm = clip_grad_norm(params, clip, stage_group(self.model))
        skipped = not math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips by itself when it found inf/nan while unscaling
            self.scaler.update()
        elif not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
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
        batch = checked_batch(self.step_batch(step), type(self).__name__)
        while True:
            totals = self._try_accumulate(step, batch)
            if totals is not None:
                return totals
            self._recover_from_oom(step)
            self.monitor.begin_step(step)  # the step's peak is that of the attempt that completes

    def _try_accumulate(self, step: int, batch: Batch) -> StepTotals | None:
        """One attempt at the step's micro-steps; None when some rank ran out of memory.

        The ranks agree before the last micro-step, the one that synchronises them (DDP all-reduces the
        gradients in its backward), so an OOM in any earlier micro-step is redone by every rank together
        and no rank is left waiting in a collective. An OOM inside the last micro-step on several ranks
        cannot be agreed on: the peers are in (or about to enter) the backend's collectives, which the
        failed rank can neither join nor cancel (answering with the agreement would pair it with a
        gradient bucket: a collective mismatch). That rank stops with a `PlanError` and issues no further
        collective, and its peers' collective fails on the lost peer (or at the collective timeout).
        """
        assert self.model is not None
        split = self.split_batch(batch, self.plan.micro_batch_size)
        micro_batches = [self._to_device(self.context_parallel_split(mb)) for mb in split]
        counts = [self.count_tokens(mb) for mb in micro_batches]
        global_tokens = int(data_parallel_sum(torch.tensor(sum(counts), dtype=torch.long), self.env))
        scale = self._sharding.grad_sync_scale(self.env) / max(global_tokens, 1)
        loss_total = torch.zeros((), dtype=torch.float64, device=self.env.device)
        if not global_tokens:  # no loss token on any rank: `train_step` skips the step
            return StepTotals(loss_sum=loss_total, global_tokens=0, micro_batches=len(micro_batches))
        self.model.train()
        if is_pipeline(self.model):  # the stages run every micro-batch (`memtrain.strategies.pipeline`)
            return StepTotals(run_step(self.model, micro_batches, scale), global_tokens, len(micro_batches))
        failed = False
        for index, micro_batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            if last and any_rank(failed, self.env):
                return None
            if failed:
                continue
            try:
                loss_total += self._micro_step(micro_batch, scale, last, counts[index] if step == 0 else None)
            except torch.OutOfMemoryError as exc:
                self.monitor.record_oom(step, index, self.plan, exc)
                if last and self.env.distributed:
                    raise self.monitor.unagreeable_oom(step, self.plan) from None
                failed = True
        return None if failed else StepTotals(loss_total, global_tokens, len(micro_batches))

    def _micro_step(
        self, micro_batch: Batch, scale: float, last: bool, expected_tokens: int | None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed loss (detached, float64). Its
        tensors live only in this frame, so an exception here releases them."""
        assert self.model is not None
        with self._sharding.micro_step(self.model, last), parallel_loss(self.env):
            with self.monitor.phase("forward"), self.plan.precision.autocast(self.env.device):
                out = self.loss(self.model, micro_batch)
                loss_sum, num_tokens = loss_output(out, f"{type(self).__name__}.loss")
            if expected_tokens is not None:
                check_token_count(num_tokens, expected_tokens)
            with self.monitor.phase("backward"):
                scaled = loss_sum * scale
                self._sharding.backward(
                    self.model, self.scaler.scale(scaled) if self.scaler is not None else scaled
                )
        return loss_sum.detach().double()

    def _recover_from_oom(self, step: int, over: OverBudget | None = None) -> None:
        """Drop the failed attempt's gradients and cached blocks, then go on with the plan the monitor
        chooses (`MemoryMonitor.replan`), switched into the live model in place."""
        assert self.model is not None and self.optimizer is not None
        if isinstance(self.optimizer, InBackwardOptimizer):
            self.optimizer.check_redoable(step)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._sharding.discard_step(self.model)
        gc.collect()
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()
        new = self.monitor.replan(step, self.plan, self.recipe, self.model_spec(), over)
        if (new.checkpointing, new.loss) != (self.plan.checkpointing, self.plan.loss):
            model = self._sharding.unwrap(self.model)
            switch_in_place(model, self._blocks, new.checkpointing, new.loss, new.compile)
        self.plan = new

    def evaluate(self) -> float:
        """Token-weighted mean loss over `eval_batches()` on every rank, combined over ranks (`evaluation`)."""
        return evaluation.mean_loss(self)

    # ------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, step: int) -> Path:
        """Atomically save everything needed to continue exactly after `step` steps
        (`RunDirectory.save_checkpoint`: a full disk on any rank is one error on every rank)."""
        meta = (
            trainer_state.checkpoint_meta(
                self.recipe,
                self.plan,
                self.env.world_size,
                self.skipped_steps,
                self._sharding.checkpoint_format_on(self.env),
            )
            | self.early_stopping.meta()
        )
        return self.run.save_checkpoint(step, self._state().write, meta, self.recipe.checkpoint.keep)

    def _state(self) -> trainer_state.TrainerState:
        assert self.model is not None and self.optimizer is not None
        return trainer_state.TrainerState(self.model, self.optimizer, self.scaler, self._sharding, self.env)

    def _start_fresh(self) -> int:
        self.run.start_fresh(self.recipe.to_dict(), self.monitor.plan_record(self.plan))
        return 0

    def _restore(self, resume: str | Path | bool, allow_recipe_change: bool = False) -> int:
        """Resume from a checkpoint (`RunDirectory.restore` picks it, falls back, and continues the
        lineage); the plan changes only once every file has loaded."""
        recipe = self.recipe.to_dict()
        found = self.run.restore(
            resume,
            lambda candidate: self._load_checkpoint(candidate, recipe, allow_recipe_change),
            (recipe, self.monitor.plan_record(self.plan)),
            self.recipe.checkpoint.fallback,
        )
        return found.step

    def _load_checkpoint(self, found: Checkpoint, recipe: dict[str, Any], allow_recipe_change: bool) -> None:
        assert self.model is not None and self.optimizer is not None
        meta = self.run.check_resumable(found, recipe, self.recipe.train.steps, allow_recipe_change)
        self._state().load(found)
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.early_stopping.load(meta)
        self.plan = trainer_state.adopt_saved_micro_batch(self.plan, meta, self.env.world_size)
        if self.env.is_main:
            print(f"[memtrain] resumed from {found.path} at step {found.step}", flush=True)

    # ------------------------------------------------------------------------------------ helpers

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.env.device, non_blocking=True) for k, v in batch.items()}
