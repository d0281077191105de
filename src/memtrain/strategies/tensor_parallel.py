"""Tensor (and sequence) parallelism over the mesh's `tp` dimension: a trainer's plan applied with torch's
`parallelize_module`, and the vocabulary-parallel loss.

Why here and why this shape: the plan is the model's business (which linears are split by columns, which by
rows, where the sequence is sharded), so a trainer hands one in (`Trainer.tensor_parallel_plan`; the built-in
causal-LM trainer builds it from the block structure, `memtrain.causal_lm.tensor_parallel`). What is the same
for every model lives here: applying it once, before activation checkpointing and FSDP (`apply_strategies`),
on the mesh the run built once, and the loss. The output head is split by vocabulary and its logits stay
sharded (a DTensor); the cross-entropy runs under torch's `loss_parallel`, which reduces the log-softmax
over the tensor ranks instead of gathering `vocabulary`-wide logits on each. `loss_parallel` must enclose
the backward too, so the trainer enters `vocabulary_parallel_loss` around each micro-step's forward and
backward (and evaluation around its forwards). The loss it returns is a replicated DTensor:
`whole_value` turns it back into the plain tensor the loop sums.

torch.distributed.tensor is imported only when a run has tp > 1 (it costs seconds at startup).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

TensorParallelPlan = Mapping[str, "ParallelStyle"]
"""Module name (relative to the model, `*` for any one name part) -> how it is split."""
PlanHook = Callable[[nn.Module], TensorParallelPlan | None]


def apply_tensor_parallel(model: nn.Module, hook: PlanHook | None, env: DistEnv) -> None:
    """Split `model`'s modules over the mesh's `tp` dimension as `hook(model)` says; `Unsupported` naming
    `strategies.mesh.tp` when there is no plan (the hook's trainer named)."""
    plan = hook(model) if hook is not None else None
    if plan is None:
        owner = type(getattr(hook, "__self__", None)).__name__ if hook is not None else "the trainer"
        raise Unsupported(
            f"strategies.mesh.tp: {owner} has no tensor-parallel plan (override "
            "Trainer.tensor_parallel_plan(model)); set strategies.mesh.tp: 1"
        )
    from torch.distributed.tensor.parallel import parallelize_module

    assert env.device_mesh is not None, "apply_strategies builds the run's device mesh"
    parallelize_module(model, env.device_mesh["tp"], dict(plan))


def vocabulary_parallel_loss(env: DistEnv) -> contextlib.AbstractContextManager[Any]:
    """Context for a forward and its backward: torch's `loss_parallel` when the run splits tensors (the
    cross-entropy over vocabulary-sharded logits), else nothing."""
    if env.shape.tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def whole_value(value: torch.Tensor) -> torch.Tensor:
    """A value reduced over shards (a loss over sharded logits, a norm: a replicated or partial DTensor) as
    the plain tensor every rank holds; a plain tensor unchanged."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def check_loss(loss_name: str, tp: int) -> None:
    """Only the standard loss reads logits through the head's forward, which tensor parallelism splits."""
    if tp > 1 and loss_name != "standard":
        raise Unsupported(
            f"strategies.loss: {loss_name} applies the output head's weight itself, which tensor parallelism "
            f"(strategies.mesh.tp={tp}) splits by vocabulary; use strategies.loss=standard (its logits stay "
            "sharded by vocabulary)"
        )


def clip_grad_norm(
    params: Sequence[torch.Tensor], max_norm: float | None, stages: dist.ProcessGroup | None = None
) -> float:
    """torch's `clip_grad_norm_` (the 2-norm over every gradient; `max_norm` None: measured, not clipped),
    also for DTensor gradients on a mesh. torch's cannot stack the norms of gradients on different meshes (a
    model split by tensor parallelism and sharded by FSDP has them on the (dp, tp) mesh beside those of
    parameters whole on every tensor rank, on the dp mesh), and with torch 2.13 both its norm and its
    in-place scaling of a gradient FSDP shards over an already tensor-parallel dimension (`_StridedShard`)
    came out wrong (a norm of 0.86 for 0.95; factors differing per tensor). Here each gradient's squares are
    summed from this rank's shard and added over the mesh dimensions that shard it (`_squares`), and every
    gradient is scaled by one factor, computed as torch's is. `stages`: the group of pipeline stages, each
    holding other parameters (`memtrain.strategies.pipeline.stage_group`), over which the squares add up."""
    limit = max_norm if max_norm is not None else math.inf
    if stages is None and not any(hasattr(p, "device_mesh") for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, limit))
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")  # nccl reduces device tensors
    squares = torch.tensor(sum(_squares(g) for g in grads), dtype=torch.float64, device=device)
    if stages is not None:
        dist.all_reduce(squares, group=stages)
    total = math.sqrt(float(squares))
    factor = limit / (total + 1e-6)
    if factor < 1.0:
        with torch.no_grad():
            for grad in grads:
                grad.mul_(factor)
    return total


def _squares(grad: torch.Tensor) -> float:
    """The sum of the squares of a whole gradient, from this rank's shard (a collective for a DTensor: summed
    over the mesh dimensions that do not replicate it; a partial gradient is reduced first)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(grad, DTensor):
        return float(grad.detach().float().square().sum())
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    if placements != list(grad.placements):
        grad = grad.redistribute(grad.device_mesh, placements)
    local = grad.to_local().detach().float().square().sum()
    summed = [Replicate() if p.is_replicate() else Partial() for p in placements]
    return float(DTensor.from_local(local, grad.device_mesh, summed, run_check=False).full_tensor())
