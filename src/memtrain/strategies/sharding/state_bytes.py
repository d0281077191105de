"""Per-rank bytes of the model states under each sharding backend: pure arithmetic, no torch calls.

Why not the ZeRO paper's `16Ψ/N`: the planner must predict what the backend really allocates, and the
backends differ from the idealisation in ways that matter at the margin of a GPU:

- DDP keeps a second copy of every gradient in its all-reduce buckets (`gradient_as_bucket_view`
  is off by default), so replicated training holds weights + 2 x gradients + optimizer states.
- torch's ZeroRedundancyOptimizer (our zero1) partitions whole tensors, largest first, each to the
  rank with the fewest elements so far: ranks are uneven, and the largest tensor (often the
  embedding) sets the per-rank maximum. It runs over DDP, so the buckets stay.
- FSDP2 shards every tensor on dim 0 in `ceil(dim0 / N)` rows and pads the last ranks' shards to
  that size (the padded buffer is what is allocated; the optimizer sees the unpadded view). It
  all-gathers one FSDP group (a block, or the root's embedding/norm/head) at a time into a padded
  flat buffer in the compute dtype (bf16 under bf16-mixed). zero3 frees a block's gathered weights
  after its forward and re-gathers them in backward, prefetching the next block (two blocks
  gathered at once); the root is kept gathered from forward to backward (FSDP2's default for the
  root). zero2 (`reshard_after_forward=False`) keeps every gathered weight from forward to backward.
  With accumulation and `gradient_reduction=per_step`, gradients are not reduced on non-final
  micro-steps, so each rank holds an unsharded fp32 gradient of the whole model until the last
  micro-step; with `per_micro_step` every micro-step reduce-scatters into the sharded gradient.
  A QLoRA base (`QuantisedWeight`) is sharded and gathered as its packed uint8 storage, its
  quantisation constants whole on every rank.
- DeepSpeed ZeRO-1/2 flattens the parameters into one buffer (padded to a multiple of 2 x the world
  size) that stays whole on every rank, keeps a separate fp32 master partition even when training in
  fp32, and keeps the gradients of every parameter that overlaps its partition - whole. ZeRO-3 pads
  each parameter to a multiple of the world size and partitions it, frozen or not (a LoRA base is
  `1/N` per rank, as under FSDP2), and keeps a persistent flat gradient partition of the trainable ones. It
  keeps gathered both the parameters of at most `stage3_param_persistence_threshold` elements and,
  from the second step on, every weight reused within `stage3_max_reuse_distance` elements: with the
  defaults, all weights of a model under 500M parameters stay gathered from forward to backward.
  Under accumulation ZeRO-2/3 reduce every micro-step into their gradient partitions (the engine's
  `allreduce_gradients`: "ZeRO stage >= 2 communicates during non gradient accumulation boundaries as
  well"), while ZeRO-1 keeps every full gradient until the boundary's reduction.

Every function returns a `StateBytes` for one rank (`rank=None`: the most loaded rank). The tests
measure the persistent states (weights, gradients, optimizer states, buffers) and the weights gathered
at the end of forward to the byte; the other transients (backward prefetch, extra gradient copies)
are modelled from the backends' source. `StateBytes.footprint` adds the transients to the persistent
states as if they were alive at once: an upper bound, since gathered weights (forward) and reduced
gradients (after backward) do not peak together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo

STEP_BYTES = 4  # torch AdamW's 0-dim float32 `step` per parameter tensor


@dataclass(frozen=True)
class DTypes:
    """Bytes per element of what a precision stores and computes with."""

    param: int  # stored parameters (fp32 master copy for the mixed precisions)
    grad: int  # gradients as the optimizer sees them
    compute: int  # parameters as the forward pass reads them (FSDP2's all-gather dtype)


def dtypes(precision: str) -> DTypes:
    """bf16-master and bf16-true store bf16; the autocast precisions store fp32 and (under FSDP2) gather
    bf16."""
    if precision in ("bf16-master", "bf16-true"):
        return DTypes(param=2, grad=2, compute=2)
    if precision in ("bf16-mixed", "fp16-mixed", "fp8"):
        return DTypes(param=4, grad=4, compute=2)
    return DTypes(param=4, grad=4, compute=4)


@dataclass(frozen=True)
class OptimizerCost:
    """What the optimizer keeps per parameter element and per parameter tensor (AdamW: 8 and 4), or, for
    states whose size follows each tensor's shape (Adafactor's factors, GaLore's projections),
    `by_tensor`: the exact bytes of each trainable tensor, in the model's order."""

    per_element: float = 8.0
    per_tensor: int = STEP_BYTES
    by_tensor: tuple[int, ...] = ()

    def bytes(self, numel: int, tensors: int) -> int:
        return int(math.ceil(self.per_element * numel)) + self.per_tensor * tensors

    def of_tensors(self, indices: Iterable[int], numels: list[int]) -> int:
        """The states of the trainable tensors at `indices` (whole tensors: zero1's partitions)."""
        chosen = list(indices)
        if self.by_tensor:
            return sum(self.by_tensor[i] for i in chosen)
        return self.bytes(sum(numels[i] for i in chosen), len(chosen))


ADAMW = OptimizerCost()  # torch AdamW over fp32 parameters: two fp32 moments and a 0-dim fp32 step


@dataclass(frozen=True)
class StateBytes:
    """One rank's model-state bytes on the device, by component (and what offload put on the host)."""

    weights: int = 0  # parameters stored on this rank between steps
    gradients: int = 0  # gradients this rank holds when the optimizer steps
    optimizer_states: int = 0  # optimizer moments, step counters and master copies on this rank
    buffers: int = 0  # communication buffers the backend keeps for the whole run (DDP buckets)
    gathered: int = 0  # transient: unsharded weights alive at the end of forward
    prefetch: int = 0  # transient: extra unsharded weights alive during backward (zero3 prefetch)
    gradient_copies: int = 0  # transient: FSDP2's unsharded accumulation, DeepSpeed's full/fp32 copies
    host: int = 0  # states moved to host memory by offload (not counted in the device components)

    @property
    def persistent(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.buffers

    @property
    def peak(self) -> int:
        return self.persistent + self.gathered + self.prefetch + self.gradient_copies

    def footprint(self, base: Footprint) -> Footprint:
        """`base` with the model-state components replaced by these device bytes (upper bound)."""
        return base.with_(
            weights=self.weights + self.gathered + self.prefetch,
            gradients=self.gradients + self.gradient_copies,
            optimizer_states=self.optimizer_states,
            other=base.other + self.buffers,
        )


# ----------------------------------------------------------------------------------- replicated


def replicated_bytes(shape: ModelShape, precision: str, optimizer: OptimizerCost, ddp: bool) -> StateBytes:
    """`none` and `ddp`: every rank holds everything; DDP adds its gradient buckets (trainable only)."""
    kinds = dtypes(precision)
    trainable = shape.trainable
    grads = trainable.numel * kinds.grad
    return StateBytes(
        weights=shape.numel * kinds.param,
        gradients=grads,
        optimizer_states=optimizer.bytes(trainable.numel, len(trainable.params)),
        buffers=grads if ddp else 0,
    )


def zero_redundancy_partition(numels: Iterable[int], world_size: int) -> list[list[int]]:
    """Indices of the tensors each rank steps, as torch's ZeroRedundancyOptimizer assigns them:
    largest first (stable for ties), each to the first rank with the fewest elements so far."""
    indexed = list(enumerate(numels))
    order = sorted(indexed, key=lambda item: item[1], reverse=True)
    sizes = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for index, numel in order:
        rank = sizes.index(min(sizes))
        ranks[rank].append(index)
        sizes[rank] += numel
    return ranks


def zero1_bytes(
    shape: ModelShape, world_size: int, precision: str, optimizer: OptimizerCost, rank: int | None = None
) -> StateBytes:
    """zero1 (fsdp2 backend): DDP with ZeroRedundancyOptimizer; only the optimizer is partitioned."""
    full = replicated_bytes(shape, precision, optimizer, ddp=True)
    trainable = shape.trainable.params
    parts = zero_redundancy_partition((p.numel for p in trainable), world_size)

    def states(r: int) -> int:
        return optimizer.of_tensors(parts[r], [p.numel for p in trainable])

    mine = states(rank) if rank is not None else max(states(r) for r in range(world_size))
    return StateBytes(
        weights=full.weights, gradients=full.gradients, optimizer_states=mine, buffers=full.buffers
    )


# ----------------------------------------------------------------------------------------- FSDP2


@dataclass(frozen=True)
class QuantisedWeight:
    """A frozen base weight stored quantised (QLoRA under FSDP2): its packed storage, `rows` rows of
    `row_bytes` bytes on dim 0, is what FSDP2 shards and all-gathers as it is stored (an integer tensor: no
    mixed-precision cast; the layer dequantises it in its forward), and `whole` bytes of quantisation
    constants stay whole on every rank (bitsandbytes keeps them on the module, beside the parameter)."""

    rows: int
    row_bytes: int
    whole: int


def fsdp2_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 shard (torch.chunk semantics, empty chunks for the last ranks)."""
    chunk = math.ceil(dim0 / world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def _groups(shape: ModelShape) -> dict[int | None, list[ParamInfo]]:
    """FSDP groups: one per block, and the root (block None) for everything outside the blocks."""
    groups: dict[int | None, list[ParamInfo]] = {}
    for p in shape.params:
        groups.setdefault(p.block, []).append(p)
    return groups


def fsdp2_bytes(
    shape: ModelShape,
    world_size: int,
    precision: str,
    optimizer: OptimizerCost,
    *,
    reshard_after_forward: bool,
    accumulation_steps: int = 1,
    reduce_every_micro_step: bool = False,
    offload: bool = False,
    dim0: Mapping[str, int] | None = None,
    rank: int | None = None,
    quantised: Mapping[str, QuantisedWeight] | None = None,
) -> StateBytes:
    """zero2 / zero3 on FSDP2 (`fully_shard` per block, then the root). `reduce_every_micro_step`:
    `gradient_reduction=per_micro_step` (no unsharded gradient between micro-steps).

    `dim0` gives each parameter's leading dimension (by name) for the padding arithmetic; without
    it every parameter is taken as 1-D (padding of at most `world_size - 1` elements per tensor).
    `quantised`: the frozen base weights stored quantised, by name (`QuantisedWeight`): their shards and
    gathered copies are of the packed storage, their constants whole on this rank.
    """
    if rank is None:
        # The busiest rank is rank 0: every tensor's shard is padded to the same ceil(rows / N) rows on every
        # rank (weights, gradients, gathered groups), and only the optimizer states follow the unpadded local
        # rows, of which torch.chunk gives rank 0 the most (a full chunk, or the whole tensor when it is
        # shorter than one); state bytes grow with elements. Visiting every rank cost 1024 ranks x every
        # parameter per plan (a 405B what-if on 1,024 GPUs: minutes).
        rank = 0
    kinds = dtypes(precision)
    rows_of = dim0 or {}

    def shard(p: ParamInfo, r: int) -> tuple[int, int]:
        """(padded, local) elements of `p` on rank r."""
        rows = rows_of.get(p.name, p.numel)
        per_row = p.numel // rows
        return math.ceil(rows / world_size) * per_row, fsdp2_rows(rows, world_size, r) * per_row

    packed = quantised or {}

    def stored(p: ParamInfo) -> int:
        """This rank's bytes of `p` between steps."""
        if (q := packed.get(p.name)) is not None:
            return math.ceil(q.rows / world_size) * q.row_bytes + q.whole
        return shard(p, rank)[0] * kinds.param

    def all_gathered(p: ParamInfo) -> int:
        """`p` all-gathered (padded), as the forward reads it."""
        if (q := packed.get(p.name)) is not None:
            return world_size * math.ceil(q.rows / world_size) * q.row_bytes
        return world_size * shard(p, rank)[0] * kinds.compute

    trainable = shape.trainable.params
    padded_trainable = sum(shard(p, rank)[0] for p in trainable)
    local_trainable = sum(shard(p, rank)[1] for p in trainable)
    groups = _groups(shape)

    def gathered_group(params: list[ParamInfo]) -> int:
        return sum(all_gathered(p) for p in params)

    root = gathered_group(groups.get(None, []))
    largest_block = max((gathered_group(v) for k, v in groups.items() if k is not None), default=0)
    everything = sum(gathered_group(v) for v in groups.values())
    states = StateBytes(
        weights=sum(stored(p) for p in shape.params),
        gradients=padded_trainable * kinds.grad,
        optimizer_states=optimizer.bytes(local_trainable, len(trainable)),
    )
    gathered = root if reshard_after_forward else everything
    # zero3 re-gathers the block in backward and prefetches the next one: two blocks at once.
    prefetch = 2 * largest_block if reshard_after_forward else 0
    unsharded = accumulation_steps > 1 and not reduce_every_micro_step
    copies = shape.trainable_numel * kinds.grad if unsharded else 0  # unsharded accumulated grads
    if offload:  # a quantised weight's constants are not a parameter: they stay on the device
        constants = sum(q.whole for q in packed.values())
        return StateBytes(
            weights=constants,
            gathered=gathered,
            prefetch=prefetch,
            gradient_copies=copies,
            host=states.weights - constants + states.gradients + states.optimizer_states,
        )
    return StateBytes(
        weights=states.weights,
        gradients=states.gradients,
        optimizer_states=states.optimizer_states,
        gathered=gathered,
        prefetch=prefetch,
        gradient_copies=copies,
    )


# ------------------------------------------------------------------------------------- DeepSpeed


@dataclass(frozen=True)
class DeepSpeedZero3Knobs:
    """The ZeRO-3 settings that decide how many gathered weights DeepSpeed keeps (its defaults)."""

    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold: never partitioned
    max_reuse_distance: int = 1_000_000_000  # stage3_max_reuse_distance: keep if reused within (elements)
    prefetch_bucket: int = 50_000_000  # stage3_prefetch_bucket_size (elements fetched ahead)


def deepspeed_bytes(
    shape: ModelShape,
    world_size: int,
    precision: str,
    optimizer: OptimizerCost,
    *,
    stage: int,
    offload: str = "none",
    knobs: DeepSpeedZero3Knobs = DeepSpeedZero3Knobs(),
    rank: int | None = None,
) -> StateBytes:
    """DeepSpeed ZeRO-1/2/3 with a client torch optimizer over one parameter group (`shape.params` in
    the model's parameter order, which is taken as the forward order). Model parameters are bf16
    under bf16-mixed, fp32 otherwise; master weights and moments are fp32 partitions. `offload`:
    `optimizer` moves the master partition and the moments to the host; `params` (zero3) also the
    parameter partitions.

    ZeRO-3 keeps a weight gathered after its use when the trace shows it used again within
    `max_reuse_distance` elements: at the end of forward, the parameters whose backward use comes
    within that distance (about twice the elements that run after them) stay gathered - with the
    defaults (1e9), every weight of a model under 500M parameters, as with FSDP2's zero2.

    Frozen parameters (a LoRA base) are outside the optimizer's flat groups: no gradient or state. ZeRO-1/2
    keep them whole on every rank. ZeRO-3 partitions every parameter of the module it is given, frozen or
    not (`DeepSpeedZeRoOffload._convert_to_zero_parameters`; measured: a LoRA model's `ds_tensor`s on 2
    ranks are half of it), and gathers, keeps and prefetches them as it does the trainable ones: a frozen
    base weighs `1/N` of itself per rank, plus what is gathered in flight.
    """
    if rank is None:
        per_rank = [
            deepspeed_bytes(
                shape, world_size, precision, optimizer, stage=stage, offload=offload, knobs=knobs, rank=r
            )
            for r in range(world_size)
        ]
        return max(per_rank, key=lambda b: (b.peak, b.host))
    element = 2 if precision == "bf16-mixed" else 4
    if stage == 3:
        return _deepspeed_zero3_bytes(shape, world_size, element, optimizer, offload, knobs)
    frozen = (shape.numel - shape.trainable_numel) * element
    shape = shape.trainable
    flat = sum(p.numel for p in shape.params)
    align = 2 * world_size
    flat = math.ceil(flat / align) * align
    partition = flat // world_size
    start, end = rank * partition, (rank + 1) * partition
    overlapping, offset = 0, 0
    for p in shape.params:
        if offset < end and offset + p.numel > start:
            overlapping += p.numel
        offset += p.numel
    states = optimizer.bytes(partition, 1) + partition * 4
    # Stage 1 holds every full gradient until the boundary's reduction; both stages convert their
    # partition to a fresh fp32 flat gradient inside the optimizer step.
    full_grads = shape.numel * element if stage == 1 else 0
    return StateBytes(
        weights=frozen + flat * element,
        gradients=overlapping * element,
        optimizer_states=0 if offload != "none" else states,
        gradient_copies=full_grads + partition * 4,
        host=states if offload != "none" else 0,
    )


def _deepspeed_zero3_bytes(
    shape: ModelShape,
    world_size: int,
    element: int,
    optimizer: OptimizerCost,
    offload: str,
    knobs: DeepSpeedZero3Knobs,
) -> StateBytes:
    """ZeRO-3: every parameter's partition (frozen ones too) on each rank, the trainable ones' flat gradient
    and optimizer partitions; gathered weights kept by the persistence threshold and the reuse distance,
    frozen or not (the coordinator traces every parameter the forward fetches), and the next block fetched
    ahead."""
    partition = sum(math.ceil(p.numel / world_size) for p in shape.params)
    trainable = sum(math.ceil(p.numel / world_size) for p in shape.trainable.params)
    kept, after = 0, 0
    for p in reversed(shape.params):
        if p.numel <= knobs.persistence_threshold or 2 * after < knobs.max_reuse_distance:
            kept += p.numel
        after += p.numel
    largest_block = max(
        (sum(p.numel for p in v) for k, v in _groups(shape).items() if k is not None), default=0
    )
    states = optimizer.bytes(trainable, 1) + trainable * 4  # moments + fp32 master partition
    weights = partition * element
    host = states + (weights if offload == "params" else 0) if offload != "none" else 0
    return StateBytes(
        weights=0 if offload == "params" else weights,
        gradients=trainable * element,  # the flat gradient partition, allocated at initialisation
        optimizer_states=0 if offload != "none" else states,
        gathered=kept * element,
        prefetch=min(shape.numel - kept, largest_block + knobs.prefetch_bucket) * element,
        gradient_copies=trainable * 4,  # the fp32 flat gradient the step builds from the partition
        host=host,
    )
