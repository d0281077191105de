"""Model-state levels of one rank for one plan, from the strategies' own arithmetic.

Why here and not in the strategies: each strategy's `estimate` answers its own question (the most bytes a
component reaches); the memory model needs the levels at particular moments of the step, and which
estimate is authoritative depends on the sharding. Replicated plans (none, ddp) take weights, gradients
and optimizer states from `Precision.estimate` and `OptimizerStates.estimate`, exact to the byte (tests in
tests/strategies/), plus DDP's bucket copy from the backend. Sharded plans take the backend's per-rank
`estimate`, which follows what FSDP2, ZeroRedundancyOptimizer or DeepSpeed really allocate, with the
optimizer-state format passed as an `OptimizerCost`. No byte arithmetic of those strategies is repeated.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from memtrain.footprint import Footprint, ModelShape
from memtrain.planner.memory_model import StateLevels, optimizer_extra
from memtrain.recipe import Recipe
from memtrain.strategies.optimizer import STEP_TENSOR_BYTES, OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding import ShardingBackend
from memtrain.strategies.sharding_bytes import OptimizerCost

REPLICATED = ("none", "ddp")
DATA_BYTES_PER_TOKEN = 16  # input_ids and labels, int64 each
DATA_BYTES_PER_ROW = 8  # the sample id


def step_data_bytes(rows: int, seq_len: int) -> int:
    """The step batch of this rank on the device (the trainer moves every micro-batch of a step at once)."""
    return rows * (seq_len * DATA_BYTES_PER_TOKEN + DATA_BYTES_PER_ROW)


def host_dataset_bytes(recipe: Recipe) -> int:
    """Token storage of the training data, which lives in host memory. On a CPU host memory is the device
    (the tracker and the simulated budget count it once touched): every training sample, at 8 bytes per
    token; for text and jsonl the file size stands in for its token count (exact for the byte tokenizer,
    an upper bound for others)."""
    data = recipe.data
    if data.source == "synthetic":
        return int(data.synthetic.num_samples * (1 - data.eval_fraction)) * (data.seq_len + 1) * 8
    path = Path(data.path or "")
    return path.stat().st_size * 8 if path.is_file() else 0


def optimizer_cost(shape: ModelShape, optimizer_states: str) -> OptimizerCost:
    """`OptimizerStates.estimate` as the per-element / per-tensor cost the sharding backends divide."""
    total = OptimizerStates(optimizer_states).estimate(shape, Footprint()).optimizer_states
    per_tensor = STEP_TENSOR_BYTES if optimizer_states == "fp32" else 0
    return OptimizerCost(per_element=(total - per_tensor * len(shape.params)) / max(shape.numel, 1),
                         per_tensor=per_tensor)


def state_levels(shape: ModelShape, *, precision: str, optimizer_states: str, backend: ShardingBackend,
                 world_size: int, dim0: Mapping[str, int], fixed_bytes: int, foreach: bool) -> StateLevels:
    """Levels for `StateLevels`; `fixed_bytes`: buffers and the step's data; `foreach`: the optimizer runs
    torch's multi-tensor AdamW (CUDA's default)."""
    master = precision == "bf16-master"
    if backend.name in REPLICATED:
        fp = OptimizerStates(optimizer_states).estimate(shape, Precision(precision).estimate(shape, Footprint()))
        backward_gradients = shape.numel * (2 if master else 4)
        return StateLevels(
            weights=fp.weights, optimizer_states=fp.optimizer_states,
            gradients=backward_gradients, optimizer_gradients=fp.gradients,
            optimizer_extra=optimizer_extra(shape, optimizer_states, foreach, master),
            other=fixed_bytes + backend.state_bytes(shape, world_size).buffers,
            stored=(fp.weights, backward_gradients, fp.optimizer_states),
        )
    per_rank = backend.state_bytes(shape, world_size, optimizer_cost(shape, optimizer_states), dim0=dim0)
    fp = per_rank.footprint(Footprint())  # what the backend's `estimate` returns
    extra = optimizer_extra(shape, optimizer_states, foreach, master)
    return StateLevels(
        weights=fp.weights, optimizer_states=fp.optimizer_states, gradients=fp.gradients,
        optimizer_gradients=fp.gradients, optimizer_extra=extra // world_size if foreach else extra,
        other=fixed_bytes + fp.other, replicated=False,
        stored=(per_rank.weights, per_rank.gradients, per_rank.optimizer_states),
    )
