"""One rank's memory and step time on a mesh, from the same plan scored on its data-parallel dimensions alone.

Why derived and not traced per mesh: a what-if for 1,024 GPUs visits hundreds of arrangements; the search
traces the model once per precision and recompute mode at one rank's tokens (the sequence already divided by
the context-parallel degree), scores every plan on the data-parallel arrangement (replicas x shards: the
batch each rank reads, the group that shards the states), then divides by what tensor and pipeline
parallelism split. What comes from where (`SOURCES`, also in `memtrain plan --json`):

- model states: the model's parameter shapes (traced on the meta device) and the sharding's arithmetic, then
  divided per parameter: a matrix (matmul weight, embedding, head) by t, a vector (norms, biases) kept whole
  on every tensor rank; the stored shards further by c (FSDP shards over dp_shard x cp, as torchtitan does);
  a pipeline rank holds its blocks (ceil(L / p)) and its edge: the embedding on the first stage, the final
  norm and head on the last. Under tensor parallelism the embedding's gradient comes back whole on every
  tensor rank (torch 2.13 produces a Replicate gradient for a row-wise embedding): added on the first stage.
- activations: traced (the kept bytes per block and the rest at the peak, `Evaluation.block_activations`),
  divided by t with sequence parallelism, by (10 + 24/t) / 34 without it (Korthikanti et al. 2022: layer
  norms, dropout masks and residuals stay whole; flash attention has no s^2 term); a pipeline rank keeps
  blocks of several micro-batches in flight (`in_flight_blocks`). Plus what torch's tensor-parallel program
  holds that no division of one rank's trace gives (`tensor_parallel_extra`): under sequence parallelism a
  column-parallel linear saves its all-gathered, whole-sequence input (two per block, the attention's and
  the MLP's, in every block that keeps its activations and in the one recomputing; the head's at the
  loss), and torch's vocabulary-parallel loss (`loss_parallel`) computes the log-softmax and its backward
  from separate ops (shifted logits and their exponential; zeros, exponential and sum), one fp32
  logits-sized tensor more than the fused kernels the trace ran.
- communication: bytes per collective (REFERENCE.md: a ring moves (k-1)/k of the whole) over the link the
  group crosses (memtrain.cluster), FSDP's and context parallelism's hidden behind compute as far as compute
  lasts (prefetch, ring attention), tensor parallelism's and the pipeline's exposed.
- a mixture of experts (`moe`): compute at its active parameters (k of E experts per token); under expert
  parallelism the busiest ep rank at its routed load, its E / ep gathered experts and its all-to-alls
  (expert_parallel.py). At ep = 1 without a capacity factor the memory is the traced plan's, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memtrain.cluster import Cluster
from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo
from memtrain.mesh import MeshShape
from memtrain.plan import Plan
from memtrain.planner.cost import COMM_OVERLAP
from memtrain.planner.expert_parallel import (
    ExpertCost,
    MoePlanning,
    active_numel,
    all_to_all_seconds,
    expert_cost,
    expert_numel,
    gathered_expert_share,
    moe_layers,
)
from memtrain.planner.result import Scored

SOURCES = {
    "model states": "parameter shapes (meta device) and the sharding's arithmetic, divided per parameter by "
    "the mesh (formula: matrices / t, vectors whole, stored shards / c, blocks / p)",
    "activations": "traced at one rank's tokens (sequence / c), divided by t (sequence parallel) or "
    "(10 + 24/t) / 34 (formula), pipeline micro-batches in flight per the schedule (formula), plus the "
    "sequence-parallel all-gathered inputs and the vocabulary-parallel loss's fp32 logits (formula)",
    "communication": "bytes per collective over the link each dimension crosses (formula)",
}
EXPERT_SOURCE = {  # beside SOURCES for a mixture-of-experts job
    "expert parallelism": "the busiest ep rank's routed rows at strategies.moe.max_load (or capacity), "
    "its kept rows, all-to-all buffers, gathered experts and all-to-alls (formula: expert_parallel.py)",
}


@dataclass(frozen=True)
class Stage:
    """What one pipeline rank holds: parameters on this tensor rank (before data-parallel sharding), the
    share of the model's blocks and whether it holds the embedding."""

    numel: float
    trainable_numel: float
    blocks: int
    first: bool


@dataclass(frozen=True)
class MeshCost:
    """One plan on one mesh: the busiest rank's memory, its step time and the exposed communication per
    dimension (seconds per step)."""

    footprint: Footprint
    step_seconds: float
    compute_seconds: float
    bubble_seconds: float
    exposed: dict[str, float]
    experts: ExpertCost | None = None  # a mixture-of-experts job's routed load on this mesh

    @property
    def peak(self) -> int:
        return self.footprint.peak


def stages(shape: ModelShape, mesh: MeshShape) -> list[Stage]:
    """The first and the last pipeline stage (one stage without a pipeline), on tensor rank 0."""
    blocks = math.ceil(shape.num_blocks / mesh.pp)

    def on_rank(p: ParamInfo) -> float:
        return p.numel / mesh.tp if len(p.dims) >= 2 else float(p.numel)

    in_blocks = [p for p in shape.params if p.block is not None]
    edges = [p for p in shape.params if p.block is None]
    per_block = sum(on_rank(p) for p in in_blocks) / max(shape.num_blocks, 1)
    trained_per_block = sum(on_rank(p) for p in in_blocks if p.trainable) / max(shape.num_blocks, 1)
    found = []
    for first in (True, False) if mesh.pp > 1 else (True,):
        mine = [p for p in edges if mesh.pp == 1 or _is_embedding(p) == first]
        found.append(
            Stage(
                numel=per_block * blocks + sum(on_rank(p) for p in mine),
                trainable_numel=trained_per_block * blocks + sum(on_rank(p) for p in mine if p.trainable),
                blocks=blocks,
                first=first,
            )
        )
    return found


def in_flight_blocks(mesh: MeshShape, micro_batches: int, stage: Stage, num_blocks: int) -> float:
    """Blocks' worth of one micro-batch's kept activations a pipeline rank holds at once: all its
    micro-batches under GPipe; under 1F1B the first stage min(m, p) (the last one); under interleaved 1F1B
    with v = 2 chunks per rank, torch's warm-up of (v-1)p + 2(p-1-rank) chunks plus one, of L / (p v) blocks
    each. Without a pipeline: the model's blocks, one micro-batch (accumulation runs them one by one)."""
    p, m = mesh.pp, micro_batches
    if p == 1:
        return float(num_blocks)
    if mesh.pp_schedule == "gpipe":
        return float(m * stage.blocks)
    if mesh.pp_schedule == "interleaved_1f1b":
        v = 2
        rank = 0 if stage.first else p - 1
        chunks = min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1)
        return chunks * num_blocks / (p * v)
    return float((min(m, p) if stage.first else 1) * stage.blocks)


def activation_share(mesh: MeshShape) -> float:
    """What one tensor rank keeps of a block's activations."""
    t = mesh.tp
    if t == 1:
        return 1.0
    return 1.0 / t if mesh.sequence_parallel else (10 + 24 / t) / 34


def tensor_parallel_extra(
    mesh: MeshShape, plan: Plan, stage: Stage, flight: float, *, tokens: int, hidden: int, vocab: int
) -> int:
    """Bytes one tensor rank holds at a micro-step's peak beyond the traced step divided by t (module
    docstring), `tokens` per micro-batch on this rank, `flight` blocks' worth kept (`in_flight_blocks`):
    the higher of the loss's moment (on the stage with the head) and a block's in backward, as the
    divided trace does not say which of them its peak is."""
    t = mesh.tp
    if t == 1:
        return 0
    state = tokens * hidden * (4 if plan.precision.compute == "fp32" else 2)  # a micro-batch's hidden states
    gathered = state * (1 - 1 / t) if mesh.sequence_parallel else 0.0  # whole where the trace had 1/t
    at_loss = 0.0
    if mesh.pp == 1 or not stage.first:  # loss_parallel: fp32 logits split by vocabulary, one more of them
        at_loss = tokens * vocab / t * 4 + gathered
    whole_forward = plan.checkpointing.recompute == "forward"  # a recomputed block saves nothing until then
    marks = plan.checkpointing.checkpointed(stage.blocks)
    keeping = sum(1 for m in marks if not (m and whole_forward)) / max(stage.blocks, 1)
    recomputing = 1 if whole_forward and any(marks) else 0
    in_block = 2 * gathered * (keeping * flight + recomputing)
    return int(max(at_loss, in_block))


def mesh_cost(
    flat: Scored,
    mesh: MeshShape,
    shape: ModelShape,
    block_activations: tuple[float, float],
    *,
    cluster: Cluster,
    hidden: int,
    seq_len: int,
    moe: MoePlanning | None = None,
) -> MeshCost:
    """The busiest rank of `mesh` for `flat`, the plan scored on the mesh's data-parallel dimensions at one
    rank's sequence (`seq_len`, already divided by cp); `block_activations`: (kept per block, the rest at
    the peak) of one micro-step; `moe`: a mixture-of-experts job's routing (expert_parallel.py)."""
    return max(
        (
            _stage_cost(flat, mesh, shape, stage, block_activations, cluster, hidden, seq_len, moe)
            for stage in stages(shape, mesh)
        ),
        key=lambda c: (c.peak, c.step_seconds),
    )


def _stage_cost(
    flat: Scored,
    mesh: MeshShape,
    shape: ModelShape,
    stage: Stage,
    block_activations: tuple[float, float],
    cluster: Cluster,
    hidden: int,
    seq_len: int,
    moe: MoePlanning | None = None,
) -> MeshCost:
    plan, levels = flat.plan, flat.states
    weights_share = stage.numel / max(shape.numel, 1)
    trained_share = stage.trainable_numel / max(shape.trainable_numel, 1)
    sharded = plan.sharding.gradient_sync == "reduce-scatter"
    c = mesh.cp if sharded else 1
    stored_w, stored_g, stored_o = levels.stored
    embedding_gradient = 0
    if mesh.tp > 1 and stage.first:
        embedding = sum(p.numel for p in shape.params if _is_embedding(p) and p.trainable)
        embedding_gradient = int(embedding * (1 - 1 / mesh.tp) * plan.precision.stored_dtype.itemsize)
    kept, rest = block_activations
    vocab = max((p.dims[0] for p in shape.params if _is_embedding(p) and len(p.dims) == 2), default=0)
    micro_batches = plan.accumulation_steps
    flight = in_flight_blocks(mesh, micro_batches, stage, shape.num_blocks)
    experts = _experts(moe, mesh, plan, stage, shape, flight, seq_len)
    # FSDP gathers E / ep experts of a layer (and their unsharded gradients), not E
    gathered = 1 - gathered_expert_share(shape) * (1 - 1 / mesh.ep) if moe is not None else 1.0

    def divided(peak_bytes: int, stored_bytes: int, share: float) -> int:
        """The stored shards divided by c, what the moment holds beyond them (gathered layers) not."""
        return int((stored_bytes / c + max(0, peak_bytes - stored_bytes) * gathered) * share)

    def on_rank(moment: Footprint, optimizer_step: bool) -> Footprint:
        activations = moment.activations
        if mesh.pp > 1 and activations:
            activations = int(kept * flight + rest)
        # beyond buffers and input data (the levels' other), what the trace saw outside the components: in the
        # optimizer step its temporaries (per trained parameter); in a micro-step the loss's logits, split
        # over the vocabulary by the tensor ranks (loss_parallel)
        beyond = max(0, moment.other - levels.other)
        extra = (
            0
            if optimizer_step or not activations
            else tensor_parallel_extra(
                mesh, plan, stage, flight, tokens=plan.micro_batch_size * seq_len, hidden=hidden, vocab=vocab
            )
        )
        return Footprint(
            weights=divided(moment.weights, stored_w, weights_share),
            gradients=divided(moment.gradients, stored_g, trained_share) + embedding_gradient,
            optimizer_states=divided(moment.optimizer_states, stored_o, trained_share),
            activations=int(activations * activation_share(mesh))
            + extra
            + (experts.extra_bytes if experts is not None and activations else 0),
            other=int(levels.other + (beyond * trained_share / c if optimizer_step else beyond / mesh.tp)),
        )

    moments = flat.prediction.moments or (flat.prediction.at_peak,)
    footprint = max((on_rank(m, i == 1) for i, m in enumerate(moments)), key=lambda f: f.peak)
    cost = flat.cost
    # the plan was scored at one rank's sequence; its attention still reads every key of the whole one (ring
    # attention), 12 L h s FLOPs per token beside 6 per parameter (cost.py)
    attention = 12 * shape.num_blocks * hidden * seq_len
    # a mixture of experts runs k of E experts per token (cost.py counted every parameter), the busiest ep
    # rank `load` times the mean's rows
    active = active_numel(shape, moe, experts.load.load if experts is not None else 1.0)
    whole_sequence = (6 * active + attention * mesh.cp) / (6 * shape.numel + attention)
    compute = (cost.compute + cost.recompute) * weights_share * whole_sequence
    bubble = compute * (mesh.pp - 1) / (_chunks(mesh) * micro_batches) if mesh.pp > 1 else 0.0
    exposed = _exposed(flat, mesh, stage, cluster, hidden, seq_len, compute, shape, experts)
    step = (
        compute
        + bubble
        + cost.micro_steps
        + cost.optimizer * trained_share / c
        + cost.offload * weights_share
        + sum(exposed.values())
    )
    return MeshCost(footprint, step, compute, bubble, exposed, experts)


def _experts(
    moe: MoePlanning | None,
    mesh: MeshShape,
    plan: Plan,
    stage: Stage,
    shape: ModelShape,
    flight: float,
    seq_len: int,
) -> ExpertCost | None:
    """The busiest ep rank's routed load (None for a dense model): T tokens per rank (the sequence split by
    the tensor ranks under sequence parallelism, as they route), the MoE layers that keep their routed rows
    (those not recomputed, `flight` blocks' worth of them, and the one recomputing)."""
    if moe is None:
        return None
    split = mesh.tp if mesh.tp > 1 and mesh.sequence_parallel else 1
    tokens = plan.micro_batch_size * seq_len // split
    whole_forward = plan.checkpointing.recompute == "forward"
    marks = plan.checkpointing.checkpointed(stage.blocks)
    keeping = sum(1 for m in marks if not (m and whole_forward)) / max(stage.blocks, 1)
    recomputing = 1 if whole_forward and any(marks) else 0
    share = moe_layers(shape) / max(shape.num_blocks, 1)
    itemsize = 4 if plan.precision.compute == "fp32" else 2
    return expert_cost(moe, tokens, mesh.ep, share * keeping * flight + recomputing, itemsize)


def _exposed(
    flat: Scored,
    mesh: MeshShape,
    stage: Stage,
    cluster: Cluster,
    hidden: int,
    seq_len: int,
    compute: float,
    shape: ModelShape,
    experts: ExpertCost | None = None,
) -> dict[str, float]:
    """Seconds per step each dimension's collectives add to the step (hidden parts left out)."""
    plan = flat.plan
    sharding = plan.sharding
    micro = plan.accumulation_steps
    rows = plan.micro_batch_size
    gather_bytes = stage.numel * (4 if plan.precision.compute == "fp32" else 2)
    grad_bytes = stage.trainable_numel * plan.precision.stored_dtype.itemsize
    shard_group = mesh.dp_shard * mesh.cp
    data_link = cluster.link(mesh, ("dp_shard", "cp"))
    per_step, per_micro = sharding.parameter_gathers
    gathers = per_step + micro * per_micro
    reductions = sharding.reductions_per_step(micro)
    seconds: dict[str, float] = {}
    if sharding.gradient_sync == "reduce-scatter":
        # the routed experts gather and reduce over the dp_shard / ep ranks that share them, E / ep at a time
        routed = expert_numel(shape) / max(shape.numel, 1)
        groups = [(1.0, shard_group)]
        if experts is not None and mesh.ep > 1:
            groups = [(1 - routed, shard_group), (routed / mesh.ep, shard_group // mesh.ep)]
        hidden_behind = 0.0
        for part, group in groups:
            hidden_behind += data_link.ring_seconds(
                gather_bytes * part * gathers, group, gathers * stage.blocks
            )
            hidden_behind += data_link.ring_seconds(
                grad_bytes * part * reductions, group, reductions * stage.blocks
            )
        replicas = cluster.link(mesh, ("dp_replicate",))
        seconds["dp_replicate"] = (
            2 * replicas.ring_seconds(grad_bytes / shard_group, mesh.dp_replicate) * (1 - COMM_OVERLAP)
        )
    else:
        everyone = mesh.dp_size * mesh.cp
        link = cluster.link(mesh, ("dp_replicate", "dp_shard", "cp"))
        sync = 2 if sharding.gradient_sync == "all-reduce" else 0
        hidden_behind = sync * link.ring_seconds(grad_bytes * reductions, everyone, reductions)
        hidden_behind += link.ring_seconds(gather_bytes * gathers, everyone, gathers)
    activation = rows * seq_len * hidden * 2  # one micro-batch's hidden states in bf16
    if mesh.cp > 1:  # ring attention: keys and values pass c - 1 times forward, twice as often backward
        ring = 3 * micro * stage.blocks
        hidden_behind += cluster.link(mesh, ("cp",)).ring_seconds(
            2 * activation * mesh.cp * ring, mesh.cp, ring
        )
    seconds["dp_shard"] = max(hidden_behind - compute, hidden_behind * (1 - COMM_OVERLAP))
    if (
        mesh.tp > 1
    ):  # per block: 2 all-gathers + 2 reduce-scatters forward, as many backward, again if recomputed
        passes = 3 if plan.checkpointing.recompute == "forward" else 2
        count = 4 * passes * stage.blocks * micro
        seconds["tp"] = cluster.link(mesh, ("tp",)).ring_seconds(activation * count, mesh.tp, count)
    if (
        experts is not None and mesh.ep > 1
    ):  # dispatch and combine, forward and backward (again if recomputed)
        passes = 3 if plan.checkpointing.recompute == "forward" else 2
        count = 2 * passes * moe_layers(shape) * stage.blocks // max(shape.num_blocks, 1) * micro
        # the ep group: ep consecutive shard ranks, each tp x cp ranks apart
        span = mesh.ep * mesh.tp * mesh.cp
        crosses = span > cluster.gpus_per_node or cluster.gpus_per_node % span
        link = cluster.between if crosses else cluster.within
        itemsize = 4 if plan.precision.compute == "fp32" else 2
        seconds["ep"] = all_to_all_seconds(
            experts.load, hidden, itemsize, count, link.bandwidth, link.latency
        )
    if mesh.pp > 1:  # each micro-batch's activations forward and their gradients back, per chunk
        link = cluster.link(mesh, ("pp",))
        sends = 2 * micro * _chunks(mesh)
        seconds["pp"] = sends * (activation / mesh.tp / link.bandwidth + link.latency)
    return {dim: s for dim, s in seconds.items() if s > 0}


def _chunks(mesh: MeshShape) -> int:
    """Model chunks per pipeline rank (v): 2 under interleaved 1F1B."""
    return 2 if mesh.pp_schedule == "interleaved_1f1b" else 1


def _is_embedding(p: ParamInfo) -> bool:
    """An input embedding (held by the first pipeline stage): outside the blocks, named so."""
    return p.block is None and "embed" in p.name.lower()
