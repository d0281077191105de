"""`apply_plan`: a trainer's plan applied to a model, the one call of `apply_strategies` that the loop's setup
(`Trainer._setup`) and the planner's rank trace (`memtrain.training.rank_trace`) share, so the traced rank
runs the strategies the run applies, with the trainer's own hooks, in the same order."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from memtrain.distributed import DistEnv
from memtrain.errors import MemtrainError
from memtrain.plan import Plan
from memtrain.strategies.apply import Applied, apply_strategies
from memtrain.strategies.expert_parallel import ExpertLayer
from memtrain.strategies.pipeline import PipelineSplit
from memtrain.strategies.sharding.base import ShardingBackend
from memtrain.strategies.tensor_parallel import TensorParallelPlan


class Applying(Protocol):
    """What `apply_plan` reads of the trainer (`memtrain.training.trainer.Trainer`, which imports this
    module: a protocol, not an import)."""

    env: DistEnv
    sharding: ShardingBackend | None
    pipeline_split: PipelineSplit | None

    @property
    def plan(self) -> Plan: ...

    def blocks(self, model: nn.Module) -> list[nn.Module]: ...
    def build_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer: ...
    def load_weights(self, model: nn.Module) -> None: ...
    def tensor_parallel_plan(self, model: nn.Module) -> TensorParallelPlan | None: ...
    def expert_parallel_plan(self, model: nn.Module) -> list[ExpertLayer] | None: ...


def apply_plan(
    trainer: Applying, model: nn.Module, materialise_in: AbstractContextManager[object] | None = None
) -> tuple[Applied, list[nn.Module]]:
    """`model` with `trainer`'s plan applied, and the blocks the strategies wrapped (a re-plan re-wraps them).
    `materialise_in`: the rank trace's fake tensors, in which a meta model's parameters are made; then no
    weights are read."""
    plan, sharding = trainer.plan, trainer.sharding
    assert sharding is not None, "the plan's sharding backend is built with the plan"
    blocks = trainer.blocks(model)
    applied = apply_strategies(
        model,
        blocks,
        plan.precision,
        plan.checkpointing,
        sharding=sharding,
        env=trainer.env,
        build_optimizer=lambda params: _checked_optimizer(trainer.build_optimizer(params), trainer),
        load_weights=trainer.load_weights if materialise_in is None else None,
        adapters=plan.adapters,
        quantization=plan.quantization,
        loss=plan.loss,
        optimizer_step=plan.optimizer_step,
        tensor_parallel=trainer.tensor_parallel_plan,
        pipeline=trainer.pipeline_split,
        expert_parallel=trainer.expert_parallel_plan,
        materialise_in=materialise_in,
        compile=plan.compile,
    )
    return applied, blocks


def _checked_optimizer(optimizer: object, trainer: Applying) -> torch.optim.Optimizer:
    """The trainer's `build_optimizer` result if it is a torch optimizer; else one line naming the hook."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise MemtrainError(
        f"{type(trainer).__name__}.build_optimizer(params) must return a torch.optim.Optimizer over params; "
        f"it returned {type(optimizer).__name__}"
    )
