"""Evaluation during training (`train.eval_every`): the eval loss over `Trainer.eval_batches()`, its
perplexity, and early stopping on it (`train.early_stopping`).

Why apart from the loop: the loop's file holds the step; what is measured between steps, and when that
measure ends the run, is decided here and called from there in a line or two.

How the eval loss is averaged: every rank sums the token losses and counts the target tokens (labels
other than -100) of its eval batches; the two sums are all-reduced and divided. The eval loss is thus the
mean over target tokens, not over rows or batches (a row weighs as many tokens as it holds), and every
rank gets the same number. The perplexity is exp of that mean (`eval_perplexity`, next to `eval_loss` in
the metrics row every logger receives).

Early stopping: an evaluation improves when its loss is below the best so far by more than
`min_delta`; after `patience` evaluations in a row without an improvement the run writes a checkpoint
and ends, with a line saying why. The count and the best loss are saved in every checkpoint (its
meta.json), so a resumed run stops at the same evaluation as one never interrupted, and resuming a run
that stopped early ends at once (raise `patience`, or remove it, to train on: a free key on resume).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from memtrain.distributed import DistEnv, data_parallel_sum
from memtrain.recipe import EarlyStoppingConfig
from memtrain.strategies.context_parallel import parallel_loss

if TYPE_CHECKING:
    from memtrain.plan import Plan
    from memtrain.strategies.sharding.base import ShardingBackend
    from memtrain.training.results import FitResult

META_KEY = "early_stopping"  # the checkpoint meta's entry with the state
Batch = dict[str, torch.Tensor]


class Evaluating(Protocol):
    """What evaluation reads of the trainer (`memtrain.training.trainer.Trainer`, which imports this
    module: a protocol, not an import)."""

    env: DistEnv
    model: nn.Module | None
    sharding: ShardingBackend | None
    early_stopping: EarlyStopping

    @property
    def plan(self) -> Plan: ...

    def eval_batches(self) -> Iterable[Batch]: ...

    def split_batch(self, batch: Batch, micro_size: int) -> list[Batch]: ...

    def context_parallel_split(self, batch: Batch) -> Batch: ...

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int | torch.Tensor]: ...

    def evaluate(self) -> float: ...


@torch.no_grad()
def mean_loss(trainer: Evaluating) -> float:
    """The token-weighted mean loss over `trainer.eval_batches()` on every rank, combined over ranks (NaN
    when no rank has an eval target token)."""
    model, plan, env = trainer.model, trainer.plan, trainer.env
    assert model is not None and trainer.sharding is not None
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    for batch in trainer.eval_batches():
        on_device = {k: v.to(env.device, non_blocking=True) for k, v in batch.items()}
        for micro_batch in trainer.split_batch(on_device, plan.micro_batch_size):
            mine = trainer.context_parallel_split(micro_batch)
            with plan.precision.autocast(env.device), parallel_loss(env):
                loss_sum, num_tokens = trainer.loss(trainer.sharding.unwrap(model), mine)
            totals[0] += loss_sum.double()
            totals[1] += float(num_tokens)
    model.train()
    totals = data_parallel_sum(totals, env)
    return float(totals[0] / totals[1]) if totals[1] > 0 else math.nan


def perplexity(loss: float) -> float:
    """exp(loss): inf past float's range, NaN for a NaN loss."""
    return math.exp(loss) if loss < 709.0 else (math.inf if loss == loss else math.nan)


def record(trainer: Evaluating, step: int, row: dict[str, Any], result: FitResult) -> None:
    """Evaluate after `step` (0-based): the eval loss and perplexity into the metrics row and the result,
    and the loss to early stopping."""
    loss = trainer.evaluate()
    row["eval_loss"], row["eval_perplexity"] = loss, perplexity(loss)
    result.eval_losses[step + 1] = loss
    trainer.early_stopping.observe(step + 1, loss)


@dataclass
class EarlyStopping:
    """The best eval loss so far (and its step) and the evaluations since it; `stopped` once
    `patience` evaluations in a row did not improve on it (never without `train.early_stopping`)."""

    config: EarlyStoppingConfig | None
    best: float | None = None
    best_step: int | None = None
    since_best: int = 0

    def observe(self, step: int, loss: float) -> None:
        """One evaluation after `step` steps (a NaN loss is no improvement)."""
        if self.config is None:
            return
        if not math.isnan(loss) and (self.best is None or loss < self.best - self.config.min_delta):
            self.best, self.best_step, self.since_best = loss, step, 0
        else:
            self.since_best += 1

    @property
    def stopped(self) -> bool:
        return self.config is not None and self.since_best >= self.config.patience

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's meta.json keeps of it."""
        return {META_KEY: {"best": self.best, "best_step": self.best_step, "since_best": self.since_best}}

    def load(self, meta: dict[str, Any]) -> None:
        """The state a checkpoint saved (`meta`), or a fresh one when it saved none."""
        saved = meta.get(META_KEY)
        saved = saved if isinstance(saved, dict) else {}
        self.best, self.best_step = _number(saved.get("best"), float), _number(saved.get("best_step"), int)
        self.since_best = _number(saved.get("since_best"), int) or 0

    def reason(self) -> str:
        assert self.config is not None
        delta = f" by more than {self.config.min_delta:g}" if self.config.min_delta else ""
        best = "" if self.best is None else f" on its best, {self.best:.4f} after step {self.best_step},"
        return (
            f"the eval loss has not improved{delta}{best} in {self.since_best} evaluations "
            f"(train.early_stopping.patience: {self.config.patience})"
        )


def _number(value: Any, kind: type[float] | type[int]) -> Any:
    """`value` as `kind` when it is a number (a meta.json edited by hand may hold anything), else None."""
    return kind(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def stop_early(trainer: Evaluating, step: int, result: FitResult, save: Callable[[int], Path]) -> bool:
    """After step `step` (0-based): when early stopping says so, a checkpoint of it (`save`), the line
    that says why, and True (end the run)."""
    if not trainer.early_stopping.stopped:
        return False
    result.stopped_early = step + 1
    path = save(step + 1)
    _announce(f"stopped after step {step + 1} with a checkpoint at {path}", trainer)
    return True


def stopped_before(trainer: Evaluating, start: int) -> bool:
    """True when the checkpoint a run resumed from (after `start` steps) had already stopped early: the
    run ends at once, saying so."""
    if not trainer.early_stopping.stopped:
        return False
    _announce(
        f"this run stopped after step {start}, nothing to train (raise train.early_stopping.patience or "
        "remove it to go on)",
        trainer,
    )
    return True


def _announce(what: str, trainer: Evaluating) -> None:
    env: DistEnv = trainer.env
    if env.is_main:
        print(f"[memtrain] early stopping: {what}: {trainer.early_stopping.reason()}", flush=True)
