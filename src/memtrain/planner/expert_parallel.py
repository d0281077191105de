"""One expert-parallel rank's memory and time beyond what the data-parallel trace of the same plan shows.

Why a formula over the traced step: the trace routes whatever the fake router routes, on one rank that holds
every expert, and the rows each expert gets are not in the shapes. Under expert parallelism (`strategies.mesh.
ep`, as torchtitan: ep borrows ranks from the FSDP shard group) the program the runtime runs per MoE layer is
known: each rank permutes its T tokens' rows by expert into a (T k, h) buffer, exchanges counts, sends the rows
to the ranks holding their experts (`all_to_all_single`, uneven, dropless), runs its E/ep experts grouped on the
R rows it received, sends the results back, unpermutes and sums. What moves with the routing is R, and the
busiest rank is the one that runs out, so the load is an explicit quantity:

- routed rows: the mean rank receives T k rows (each of ep ranks sends it T k / ep on average); the busiest
  `max_load` times that (`strategies.moe.max_load`), never more than every token's rows to its experts on
  that rank: ep T min(k, E / ep). With a capacity factor the experts' buffers are padded to capacity,
  C = ceil(cf T k / E) rows per expert from each source rank, so a rank runs ep (E / ep) C = E C rows
  whatever the routing (exact, the bound does not apply).
- activations: a layer that keeps its activations saves its received rows (the grouped GEMM's input, h per
  row), the gate/up output (2 I) and the activation's output (I, the down projection's input): (h + 3 I)
  per row in the compute dtype; the data-parallel trace kept T k of them, the busiest rank keeps R. The
  router's saved tensors (logits, scores, top-k indices and weights: T x E, T x k) and the combine's saved
  (T k, h) rows do not depend on ep and are in the trace. At the all-to-all the send buffer and the receive
  buffer are alive together (and their gradients in backward): one (T k, h) copy more than the trace's
  permuted rows, plus the receive side's (R, h), at one layer at a time.
- weights: the stored shards do not change (E / ep experts over dp_shard / ep ranks is E / dp_shard per
  rank); FSDP's all-gather of a layer gathers E / ep experts, not E, so the gathered part of the weights
  and of the unsharded gradients in backward shrinks by ep in its routed-expert share.
- time: the busiest rank computes `load` times the mean's expert FLOPs (the others wait at the all-to-all);
  four all-to-alls per MoE layer per micro-step (dispatch and combine, forward and backward; six with a
  recomputed forward) of the busiest rank's R rows, on the link the ep group crosses, not hidden; FSDP
  gathers and reduces the experts over dp_shard / ep ranks, E / ep at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memtrain.memory.footprint import ModelShape, ParamInfo


@dataclass(frozen=True)
class ExpertRouting:
    """A mixture-of-experts model's routing, from its config: routed experts per MoE layer, experts each token
    picks, the model's hidden size and each expert's intermediate size (shared experts are ordinary weights)."""

    experts: int
    top_k: int
    hidden: int
    intermediate: int


def is_routed_expert(param: ParamInfo) -> bool:
    """A routed expert's weight: inside a block, under a module named `experts` (`shared_experts` and
    `shared_expert` are not)."""
    return param.block is not None and "experts" in param.name.split(".")


def moe_layers(shape: ModelShape) -> int:
    """Blocks that hold routed experts."""
    return len({p.block for p in shape.params if is_routed_expert(p)})


def expert_numel(shape: ModelShape) -> int:
    return sum(p.numel for p in shape.params if is_routed_expert(p))


def gathered_expert_share(shape: ModelShape) -> float:
    """The routed experts' share of the largest MoE block (what FSDP gathers at once)."""
    blocks: dict[int, tuple[int, int]] = {}
    for p in shape.params:
        if p.block is not None:
            whole, experts = blocks.get(p.block, (0, 0))
            blocks[p.block] = (whole + p.numel, experts + (p.numel if is_routed_expert(p) else 0))
    largest = max(blocks.values(), default=(0, 0))
    return largest[1] / largest[0] if largest[0] else 0.0


def ep_degrees(experts: int, dp_shard: int) -> list[int]:
    """The expert-parallel degrees a mesh of `dp_shard` shard ranks can take: divisors of the experts count
    that divide the shard group."""
    return [d for d in range(1, min(experts, dp_shard) + 1) if experts % d == 0 and dp_shard % d == 0]


@dataclass(frozen=True)
class RoutedLoad:
    """The busiest expert-parallel rank's routed rows per MoE layer and micro-step."""

    tokens: int  # T: the tokens one rank routes per micro-step
    top_k: int
    ep: int
    max_load: float  # the bound assumed (strategies.moe.max_load)
    capacity_factor: float | None  # strategies.moe.capacity_factor (None: dropless)
    rows: int  # R: the busiest rank's received rows

    @property
    def mean_rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def load(self) -> float:
        """R over the mean rank's T k (1.0 on one rank without a capacity factor)."""
        return self.rows / max(self.mean_rows, 1)


def routed_load(
    routing: ExpertRouting, tokens: int, ep: int, max_load: float, capacity_factor: float | None
) -> RoutedLoad:
    """R for `tokens` per rank over `ep` ranks (module docstring): capped at capacity, else the bound, never
    above what the tokens can route to one rank's experts; one rank (dropless) receives its own T k."""
    mean = tokens * routing.top_k
    if capacity_factor is not None:
        rows = routing.experts * math.ceil(capacity_factor * mean / routing.experts)
    elif ep == 1:
        rows = mean
    else:
        most = ep * tokens * min(routing.top_k, routing.experts // ep)
        rows = min(math.ceil(mean * max_load), most)
    return RoutedLoad(tokens, routing.top_k, ep, max_load, capacity_factor, rows)


def routed_bytes_per_row(routing: ExpertRouting, itemsize: int) -> int:
    """What a layer that keeps its activations saves per routed row: its input, the gate/up output and the
    activation's output."""
    return (routing.hidden + 3 * routing.intermediate) * itemsize


def extra_activations(routing: ExpertRouting, load: RoutedLoad, kept_layers: float, itemsize: int) -> int:
    """Bytes the busiest rank holds beyond the data-parallel trace (which ran T k rows on every layer):
    `kept_layers` MoE layers' routed rows at R instead of T k, and, under ep > 1, the all-to-all's send and
    receive buffers of one layer."""
    per_row = routed_bytes_per_row(routing, itemsize)
    kept = kept_layers * (load.rows - load.mean_rows) * per_row
    in_flight = (load.mean_rows + load.rows) * routing.hidden * itemsize if load.ep > 1 else 0
    return int(kept + in_flight)


def all_to_all_seconds(
    load: RoutedLoad, hidden: int, itemsize: int, count: int, bandwidth: float, latency: float
) -> float:
    """`count` all-to-alls of the busiest rank's R rows over `ep` ranks: (ep - 1) / ep of them leave the
    rank, one message to each other rank."""
    if load.ep <= 1:
        return 0.0
    nbytes = load.rows * hidden * itemsize * (load.ep - 1) / load.ep
    return count * (nbytes / bandwidth + (load.ep - 1) * latency)


@dataclass(frozen=True)
class MoePlanning:
    """What the mesh cost needs of a mixture-of-experts job: the model's routing and the recipe's
    `strategies.moe` (the bound on the busiest rank's load, a capacity factor)."""

    routing: ExpertRouting
    max_load: float
    capacity_factor: float | None = None


@dataclass(frozen=True)
class ExpertCost:
    """What an ep plan's busiest rank pays for its routed load: the load assumed, the bytes it holds beyond
    the data-parallel trace, and what each 0.5 more of imbalance would add (bytes per rank)."""

    load: RoutedLoad
    extra_bytes: int
    per_half_load: int

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "max_load": self.load.max_load,
            "capacity_factor": self.load.capacity_factor,
            "load": self.load.load,
            "tokens_per_rank": self.load.tokens,
            "routed_rows_mean": self.load.mean_rows,
            "routed_rows_busiest": self.load.rows,
            "extra_bytes": self.extra_bytes,
            "bytes_per_half_load": self.per_half_load,
        }


def expert_cost(moe: MoePlanning, tokens: int, ep: int, kept_layers: float, itemsize: int) -> ExpertCost:
    """The busiest rank's load at the recipe's bound and what 0.5 more would cost."""
    load = routed_load(moe.routing, tokens, ep, moe.max_load, moe.capacity_factor)
    more = routed_load(moe.routing, tokens, ep, moe.max_load + 0.5, moe.capacity_factor)
    extra = extra_activations(moe.routing, load, kept_layers, itemsize)
    return ExpertCost(load, extra, extra_activations(moe.routing, more, kept_layers, itemsize) - extra)


def active_numel(shape: ModelShape, moe: MoePlanning | None, load: float) -> float:
    """The parameters each token runs through on the busiest rank: the routed experts at k / E of their
    count, times the rank's load (the dense weights whole)."""
    if moe is None:
        return float(shape.numel)
    experts = expert_numel(shape)
    return shape.numel - experts + experts * moe.routing.top_k / moe.routing.experts * load
