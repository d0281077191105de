"""`apply_strategies`: the one place a plan's strategies are applied to a model, in one fixed order.

The order (as torchtitan's parallelize does it): precision module swaps (fp8's float8 linears) ->
activation checkpointing (wraps the blocks' forwards) -> the precision's stored dtype -> [device ->
sharding (wraps the model, may shard or wrap the optimizer) -> the optimizer over the trainable
parameters, built by the precision (master weights) around the trainer's `build_optimizer`].

The trainer's setup runs all of it. The planner's trace runs the model part only (`env=None`), on a model
of fake tensors: the optimizer's states and the sharding's bytes are arithmetic, and what the forward and
backward keep is what the trace measures. Both call this function, so they cannot apply strategies in a
different order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from memtrain.distributed import DistEnv
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding.base import ShardingBackend

OptimizerBuilder = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Applied:
    """A model with every strategy applied, and what setup built around it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    grad_scaler: torch.amp.GradScaler | None = None


def apply_strategies(
    model: nn.Module,
    blocks: list[nn.Module],
    precision: Precision,
    checkpointing: Checkpointing,
    *,
    sharding: ShardingBackend | None = None,
    env: DistEnv | None = None,
    build_optimizer: OptimizerBuilder | None = None,
    weights_dtype: torch.dtype | None = None,
) -> Applied:
    """Apply the strategies in order. With `env` (training): move to the device, shard, build the
    optimizer. Without (the planner's trace): stop after the model's own strategies. `weights_dtype`
    overrides the dtype the forward reads weights in (sharding backends that hand bf16 weights to a
    bf16-mixed forward)."""
    precision.swap_modules(model, blocks)
    checkpointing.apply(model, blocks)
    dtype = weights_dtype or precision.stored_dtype
    if dtype != torch.float32:
        cast_floating(model, dtype)
    if env is None:
        return Applied(model)
    assert sharding is not None and build_optimizer is not None
    model = model.to(env.device)
    wrapped, optimizer = sharding.prepare(
        model, blocks, env, lambda m: precision.build_optimizer(m, build_optimizer)
    )
    return Applied(wrapped, optimizer, precision.grad_scaler(env.device))


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and buffers to `dtype`, in place (the same Parameter objects, as `Module.to`
    keeps them; done through `.data` because fake tensors refuse `Module.to`'s parameter swap)."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
