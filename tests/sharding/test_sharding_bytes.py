"""The sharding byte arithmetic by hand, and against the ZeRO paper's figures (REFERENCE.md).

The 2-rank tests hold these formulas to the byte against what the backends allocate; here each rule
is checked on numbers small enough to verify by hand.
"""

from __future__ import annotations

import pytest

from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo
from memtrain.strategies.sharding import make_sharding
from memtrain.strategies.sharding.state_bytes import (
    ADAMW,
    DeepSpeedZero3Knobs,
    OptimizerCost,
    deepspeed_bytes,
    fsdp2_bytes,
    replicated_bytes,
    zero_redundancy_partition,
)

# A root (embedding 10 x 4, norm 4) and two blocks of one 4 x 4 matrix each: 40 + 4 + 16 + 16 = 76.
SHAPE = ModelShape(
    (
        ParamInfo("embed", 40, None),
        ParamInfo("b0", 16, 0),
        ParamInfo("b1", 16, 1),
        ParamInfo("norm", 4, None),
    ),
    num_blocks=2,
)
ROWS = {"embed": 10, "b0": 4, "b1": 4, "norm": 4}


def test_replicated_and_ddp() -> None:
    none = replicated_bytes(SHAPE, "fp32", ADAMW, ddp=False)
    assert (none.weights, none.gradients, none.optimizer_states, none.buffers) == (
        304,
        304,
        8 * 76 + 4 * 4,
        0,
    )
    assert replicated_bytes(SHAPE, "fp32", ADAMW, ddp=True).buffers == 304  # DDP's bucket copy
    master = replicated_bytes(SHAPE, "bf16-master", ADAMW, ddp=False)
    assert (master.weights, master.gradients) == (152, 152)


def test_zero_redundancy_partition_is_greedy_largest_first() -> None:
    # sorted: 10 -> r0, 7 -> r1, 5 -> r1 (7 < 10), 3 -> r0 (10 < 12)
    assert zero_redundancy_partition([10, 7, 5, 3], 2) == [[0, 3], [1, 2]]
    assert zero_redundancy_partition([4, 4, 4], 2) == [[0, 2], [1]]  # ties keep the order


def test_zero1_partitions_only_the_optimizer() -> None:
    backend = make_sharding("zero1")
    rank0 = backend.state_bytes(SHAPE, 2, rank=0)  # 40 -> r0; 16, 16, 4 -> r1 (16 < 40, 32 < 40, 36 < 40)
    rank1 = backend.state_bytes(SHAPE, 2, rank=1)
    assert (rank0.optimizer_states, rank1.optimizer_states) == (8 * 40 + 4, 8 * 36 + 3 * 4)
    assert rank0.weights == rank1.weights == 304 and rank0.buffers == 304
    assert backend.state_bytes(SHAPE, 2) == rank0  # rank=None: the most loaded rank


def test_fsdp2_pads_dim0_shards() -> None:
    # 3 ranks: embed 10 rows -> 4 rows padded (16 elements) everywhere; rank 2 holds 2 rows (8 elements).
    rank2 = fsdp2_bytes(SHAPE, 3, "fp32", ADAMW, reshard_after_forward=True, dim0=ROWS, rank=2)
    padded = 16 + 8 + 8 + 2  # embed, b0 (4 rows -> 2), b1, norm (4 -> 2)
    local = 8 + 0 + 0 + 0  # rank 2's rows: embed 8..9, b0/b1/norm none
    assert (rank2.weights, rank2.gradients) == (4 * padded, 4 * padded)
    assert rank2.optimizer_states == 8 * local + 4 * 4  # unpadded moments, a step for every tensor
    # gathered root: 3 ranks x padded (16 + 2) x 4 bytes; prefetch: two blocks of 3 x 8 x 4
    assert (rank2.gathered, rank2.prefetch) == (3 * 18 * 4, 2 * 3 * 8 * 4)


def test_fsdp2_zero2_keeps_every_gathered_weight_and_bf16_gathers_half() -> None:
    zero2 = fsdp2_bytes(SHAPE, 2, "bf16-mixed", ADAMW, reshard_after_forward=False, dim0=ROWS, rank=0)
    assert (zero2.gathered, zero2.prefetch) == (2 * 76, 0)  # everything, in bf16, nothing padded
    assert zero2.weights == 4 * 38  # the sharded fp32 master weights


def test_fsdp2_accumulation_and_offload() -> None:
    accumulating = fsdp2_bytes(SHAPE, 2, "fp32", ADAMW, reshard_after_forward=True, accumulation_steps=4)
    assert accumulating.gradient_copies == 4 * 76  # unsharded fp32 gradients between micro-steps
    offloaded = fsdp2_bytes(SHAPE, 2, "fp32", ADAMW, reshard_after_forward=True, offload=True)
    assert offloaded.persistent == 0 and offloaded.host == 4 * 38 + 4 * 38 + 8 * 38 + 4 * 4
    assert offloaded.gathered > 0  # computing still needs the gathered weights on the device


def test_footprint_adds_transients_as_upper_bound() -> None:
    states = fsdp2_bytes(SHAPE, 2, "fp32", ADAMW, reshard_after_forward=True, accumulation_steps=2, dim0=ROWS)
    footprint = states.footprint(Footprint(activations=1000, other=7))
    assert footprint.weights == states.weights + states.gathered + states.prefetch
    assert footprint.gradients == states.gradients + states.gradient_copies
    assert footprint.activations == 1000 and footprint.other == 7
    assert make_sharding("zero3").estimate(SHAPE, Footprint(), 2, dim0=ROWS) == states.footprint(
        Footprint()
    ).with_(gradients=states.gradients)  # the backend's own estimate (no accumulation by default)


def test_deepspeed_zero12_flat_buffer_and_overlapping_gradients() -> None:
    # 76 elements padded to a multiple of 2 x 3 = 78; partitions of 26: rank 1 spans [26, 52), which
    # overlaps embed [0, 40) and b0 [40, 56): it keeps both gradients whole.
    rank1 = deepspeed_bytes(SHAPE, 3, "fp32", ADAMW, stage=2, rank=1)
    assert rank1.weights == 4 * 78
    assert rank1.gradients == 4 * (40 + 16)
    assert rank1.optimizer_states == 8 * 26 + 4 + 4 * 26  # moments + step + fp32 master partition
    stage1 = deepspeed_bytes(SHAPE, 3, "fp32", ADAMW, stage=1, rank=1)
    assert stage1.gradient_copies - rank1.gradient_copies == 4 * 76  # full gradients until the boundary


def test_deepspeed_zero3_reuse_distance_keeps_weights_gathered() -> None:
    defaults = deepspeed_bytes(SHAPE, 2, "fp32", ADAMW, stage=3)
    assert defaults.gathered == 4 * 76  # a small model: every weight is reused within 1e9 elements
    paper = deepspeed_bytes(
        SHAPE,
        2,
        "fp32",
        ADAMW,
        stage=3,
        knobs=DeepSpeedZero3Knobs(persistence_threshold=0, max_reuse_distance=0, prefetch_bucket=0),
    )
    assert paper.gathered == 0 and paper.prefetch == 4 * 16  # the block running now
    # Reuse within 2 x (elements after it): norm (0 after) and b1 (4 after) are kept at distance 10.
    near = deepspeed_bytes(
        SHAPE,
        2,
        "fp32",
        ADAMW,
        stage=3,
        knobs=DeepSpeedZero3Knobs(persistence_threshold=0, max_reuse_distance=10, prefetch_bucket=0),
    )
    assert near.gathered == 4 * (4 + 16)
    assert (paper.weights, paper.gradients) == (4 * 38, 4 * 38)


GB = 1e9
PSI, N = 7_500_000_000, 64  # the ZeRO paper's 7.5B model on 64 GPUs (REFERENCE.md): 100 blocks of
PAPER_SHAPE = ModelShape(  # 15 tensors of 5M elements
    tuple(ParamInfo(f"w{i}", 5_000_000, i // 15) for i in range(1500)), num_blocks=100
)
MOMENTS = OptimizerCost(per_element=8.0, per_tensor=0)


def test_deepspeed_bf16_matches_the_zero_paper() -> None:
    """Paper (K = 12: fp32 master + moments): ZeRO-1 31.4 GB, ZeRO-2 16.6 GB, ZeRO-3 1.9 GB per GPU.
    DeepSpeed frees stage 1's full gradients after the boundary's reduction, so its ZeRO-1 reaches the
    paper's figure only in backward (weights + full gradients + states); ZeRO-1/2 keep the gradients
    of the two tensors straddling a partition's edges whole (10M elements here, 0.02 GB)."""
    stage = {s: deepspeed_bytes(PAPER_SHAPE, N, "bf16-mixed", MOMENTS, stage=s, rank=0) for s in (1, 2, 3)}
    assert (stage[1].weights + 2 * PSI + stage[1].optimizer_states) / GB == pytest.approx(31.4, abs=0.05)
    assert stage[2].persistent / GB == pytest.approx(16.6, abs=0.05)
    assert stage[3].persistent / GB == pytest.approx(1.9, abs=0.05)
    assert replicated_bytes(
        PAPER_SHAPE, "bf16-master", OptimizerCost(per_element=12.0, per_tensor=0), ddp=False
    ).persistent / GB == pytest.approx(120, abs=0.1)


def test_fsdp2_bf16_zero3_is_sixteen_bytes_over_n() -> None:
    """FSDP2's fp32 shards double as master weights: 4 + 4 + 8 bytes per parameter, over N."""
    zero3 = fsdp2_bytes(PAPER_SHAPE, N, "bf16-mixed", MOMENTS, reshard_after_forward=True, rank=0)
    assert zero3.persistent == 16 * PSI // N
