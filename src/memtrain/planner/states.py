"""Model-state levels of one rank for one plan, from the strategies' own arithmetic.

Why here and not in the strategies: each strategy's `estimate` answers its own question (the most bytes a
component reaches); the memory model needs the levels at particular moments of the step, and which
estimate is authoritative depends on the sharding. Replicated plans (none, ddp) take weights, gradients
and optimizer states from the precision's and the optimizer-state strategy's `estimate`, exact to the byte
(tests in tests/strategies/), plus DDP's bucket copy from the backend; paged states (CUDA unified memory,
`OptimizerStates.paged_bytes`) are kept outside the device levels (the driver evicts them rather than fail
an allocation) and held to the host memory. Sharded plans take the backend's
per-rank `estimate`, which follows what FSDP2, ZeroRedundancyOptimizer or DeepSpeed really allocate, with
the optimizer-state format passed as an `OptimizerCost`. No byte arithmetic of those strategies is
repeated. Only trainable parameters have gradients and optimizer states, and of those only the ones the
step gives a gradient (`no_grad`: the trace found parameters the loss does not reach, such as a DSA indexer
used through `.detach()`): torch's optimizers skip a parameter whose `.grad` is None, and DDP leaves a
gradient it never received at None. Their weights, DDP's bucket slots and a master-weight precision's fp32
copies (made for every trainable parameter) stay. Sharded plans count them as trained: DeepSpeed's flat
buffers hold every trainable parameter's gradient and states whatever the backward reaches, and the
backends' per-rank arithmetic has no notion of an unreached parameter (over, never under). Frozen
parameters weigh what the precision stores them in (`Precision.frozen_stored_dtype`: the compute dtype
under mixed precision); the sharded plans' precision is `Sharding.as_stored`'s (their backends keep frozen
weights at the stored dtype, and so does the trainer under them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from memtrain.memory.footprint import Footprint, ModelShape
from memtrain.planner.memory_model import StateLevels, optimizer_extra
from memtrain.strategies.optimizer import OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.quantization import Quantization
from memtrain.strategies.sharding.base import ShardingBackend
from memtrain.strategies.sharding.state_bytes import OptimizerCost, QuantisedWeight


def optimizer_cost(shape: ModelShape, optimizer_states: OptimizerStates) -> OptimizerCost:
    """The optimizer-state strategy's `estimate` as the per-element / per-tensor cost the sharding
    backends divide (over the trainable parameters); tensor by tensor for states whose size follows the
    tensors' shapes (`shape_dependent`), which zero1 partitions whole."""
    trainable = shape.trainable
    total = optimizer_states.estimate(shape, Footprint()).optimizer_states
    per_tensor = optimizer_states.per_tensor_step_bytes
    by_tensor: tuple[int, ...] = ()
    if optimizer_states.shape_dependent:
        by_tensor = tuple(
            optimizer_states.estimate(ModelShape((p,), 0), Footprint()).optimizer_states
            for p in trainable.params
        )
    return OptimizerCost(
        per_element=(total - per_tensor * len(trainable.params)) / max(trainable.numel, 1),
        per_tensor=per_tensor,
        by_tensor=by_tensor,
    )


def quantised_levels(
    fp: Footprint,
    shape: ModelShape,
    quantization: Quantization,
    precision: Precision,
    linear_weights: frozenset[str],
    dim0: Mapping[str, int],
) -> Footprint:
    """The weights with the base linears stored by `quantization` (the transient dequantised copies are in
    the trace: `Quantization.stand_in`)."""
    if quantization.name == "none":
        return fp
    compute = torch.empty((), dtype=precision.autocast_dtype or precision.stored_dtype).element_size()
    return quantization.estimate(
        shape,
        fp,
        lambda p: p.name in linear_weights,
        param_bytes=precision.frozen_stored_dtype.itemsize,  # the base is frozen
        compute_bytes=compute,
        rows=lambda p: dim0.get(p.name, 1),
    )


def quantised_storage(
    shape: ModelShape, quantization: Quantization | None, linear_weights: frozenset[str]
) -> dict[str, QuantisedWeight]:
    """The base weights a sharded plan stores quantised, by name, laid out as its backend shards them (a
    plan's sharding holds a quantised base only if `Quantization.check_sharding` let it)."""
    if quantization is None or quantization.name == "none":
        return {}
    return {p.name: quantization.sharded_layout(p.numel) for p in shape.params if p.name in linear_weights}


def state_levels(
    shape: ModelShape,
    *,
    precision: Precision,
    optimizer_states: OptimizerStates,
    backend: ShardingBackend,
    replicated: bool,
    world_size: int,
    dim0: Mapping[str, int],
    fixed_bytes: int,
    foreach: bool,
    quantization: Quantization | None = None,
    linear_weights: frozenset[str] = frozenset(),
    no_grad: frozenset[str] = frozenset(),
) -> StateLevels:
    """Levels for `StateLevels`; `fixed_bytes`: buffers and the step's data; `foreach`: the optimizer runs
    torch's multi-tensor AdamW (CUDA's default); `replicated`: every rank holds every state; `no_grad`:
    trainable parameters the step leaves without a gradient (`ModelProbe.no_grad`)."""
    master = precision.master_weights
    if replicated:
        reached = _without(shape, no_grad)
        extra = optimizer_extra(reached, optimizer_states, foreach, master)
        fp = optimizer_states.estimate(reached, precision.estimate(reached, Footprint()))
        copies = (shape.trainable_numel - reached.trainable_numel) * 4 if master else 0
        weights = precision.estimate(shape, Footprint()).weights  # `reached` counts unreached ones as frozen
        fp = fp.with_(weights=weights, optimizer_states=fp.optimizer_states + copies)
        fp = quantised_levels(fp, shape, quantization or Quantization(), precision, linear_weights, dim0)
        backward_gradients = reached.trainable_numel * precision.stored_dtype.itemsize
        paged = optimizer_states.paged_bytes(reached.trainable)
        return StateLevels(
            weights=fp.weights,
            optimizer_states=fp.optimizer_states - paged,
            gradients=backward_gradients,
            optimizer_gradients=fp.gradients,
            optimizer_extra=extra,
            other=fixed_bytes + backend.state_bytes(shape, world_size).buffers,
            stored=(fp.weights, backward_gradients, fp.optimizer_states),
            paged=paged,
        )
    extra = optimizer_extra(shape, optimizer_states, foreach, master)
    per_rank = backend.state_bytes(
        shape,
        world_size,
        optimizer_cost(shape, optimizer_states),
        dim0=dim0,
        quantised=quantised_storage(shape, quantization, linear_weights),
    )
    fp = per_rank.footprint(Footprint())  # what the backend's `estimate` returns
    return StateLevels(
        weights=fp.weights,
        optimizer_states=fp.optimizer_states,
        gradients=fp.gradients,
        optimizer_gradients=fp.gradients,
        optimizer_extra=extra // world_size if foreach else extra,
        other=fixed_bytes + fp.other,
        replicated=False,
        stored=(per_rank.weights, per_rank.gradients, per_rank.optimizer_states),
        host=per_rank.host,
    )


def _without(shape: ModelShape, no_grad: frozenset[str]) -> ModelShape:
    """`shape` with the parameters named in `no_grad` frozen."""
    if not no_grad:
        return shape
    return ModelShape(
        tuple(replace(p, trainable=False) if p.name in no_grad else p for p in shape.params), shape.num_blocks
    )
