"""Expert parallelism (`strategies.mesh.ep`): each MoE layer's experts split over `ep` ranks of the shard
group, tokens sent to their experts' ranks and back by all-to-all (uneven splits, no token dropped).

Why this shape. The mesh keeps one `DeviceMesh`; its `dp_shard` dimension is unflattened into
(`dp_shard_outside_ep`, `ep`) (ep consecutive shard ranks, `memtrain.mesh`). Each experts parameter (stacked
over the experts on dim 0) becomes a DTensor `Shard(0)` on `ep`, so a checkpoint (DCP) holds every expert
under its whole shape; FSDP2 then shards it over the `dp_shard // ep` ranks outside ep (torchtitan's expert
FSDP, torch's FSDP2 EP path), while every other weight is sharded over the whole shard group as before. The
experts' gradients are reduced over those outside ranks only, but they are sums over every data-parallel
rank's tokens (the all-to-all's backward brings them), so they are divided by `ep` more on their way in
(`_ScaleGrad`: FSDP2's own divide factor is a PREMUL_SUM, which gloo lacks): the step's gradient is then
divided by the data-parallel size, as the other weights' is.

A trainer says which modules are experts (`Trainer.expert_parallel_plan(model)`: a list of `ExpertLayer`);
each such module is called as the transformers MoE families call theirs, `experts(hidden (T, h),
top_k_index (T, k), top_k_weights (T, k)) -> (T, h)`, after the family's own router, so routing (top-k, its
normalisation, the load-balancing loss) stays the family's. Its forward becomes `dispatch`:

1. the T·k (token, expert) pairs sorted by expert: a (T·k, h) buffer of rows permuted by expert;
2. how many rows go to each expert of each ep rank, exchanged (`received_counts`: the one overridable step);
3. `all_to_all_single` of the rows to the experts' ranks (uneven);
4. this rank's experts on their rows, grouped by expert (`ExpertLayer.run_local`, on the local tensors);
5. `all_to_all_single` back, unpermuted, weighted by the routing weights and summed per token.

The counts exchange is a rule (`CountRule`) the rank trace can replace (`counts_from`): under torch's fake
process group the exchanged values are garbage, so the trace says how many rows each rank receives, from an
imbalance factor (`imbalanced`) or from a measured routing (`measured`). Every dispatch records what it sent
and received (`RoutingLog`), which the metrics rows report (routed rows per rank, each layer's busiest expert
over the mean).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

LocalExperts = Callable[[nn.Module, torch.Tensor, list[int]], torch.Tensor]
"""(experts module, rows grouped by local expert (R, h), rows per local expert) -> each row's output (R, h),
unweighted; the module's parameters are this rank's experts, as plain tensors."""


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's experts as expert parallelism sees them: `module`'s parameters are all stacked over
    `num_experts` experts on dim 0, and `run_local` runs a subset of them on rows grouped by expert."""

    module: nn.Module
    num_experts: int
    run_local: LocalExperts


@dataclass(frozen=True)
class Exchange:
    """What a counts rule knows of one dispatch: `rows` (T·k) this rank sends, `ep` ranks of `local_experts`
    experts each, `layer` (the index in the trainer's plan) and this rank's index on `ep`."""

    rows: int
    ep: int
    local_experts: int
    layer: int
    ep_rank: int
    grad_scale: float = 1.0  # what the experts' gradients are multiplied by on their way in (1 / ep)
    recomputing: bool = False  # a checkpointed block's forward again, inside backward


ExpertPlanHook = Callable[[nn.Module], "list[ExpertLayer] | None"]
"""A trainer's `expert_parallel_plan`: its model's experts modules, or None (ep > 1 refused)."""


class Routed(NamedTuple):
    """What a counts rule says of one dispatch: `received[source][local expert]`, the rows this rank's
    experts receive from each ep rank, and `sent[ep rank]`, the rows this rank sends each (None: read from
    the routing, or, under fake tensors, whose counts have no values, an even split)."""

    received: list[list[int]]
    sent: list[int] | None = None


CountRule = Callable[[torch.Tensor, Exchange, Any], Routed]
"""(sent: (ep, local_experts) rows this rank sends each expert of each ep rank, the exchange, the ep process
group) -> what this rank receives (and sends)."""


def exchange_counts(sent: torch.Tensor, exchange: Exchange, group: Any) -> Routed:
    """The run's rule: every rank tells every other how many rows it sends each of its experts."""
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent.contiguous(), group=group)
    return Routed([[int(v) for v in row] for row in received.tolist()])


def imbalanced(factor: float) -> CountRule:
    """A rule for traces: this rank receives `factor` times its mean share, T·k·factor rows, spread evenly
    over its local experts and sources (1.0: a perfectly balanced router), and sends evenly."""

    def rule(_sent: torch.Tensor, exchange: Exchange, _group: Any) -> Routed:
        per_cell = math.ceil(exchange.rows * factor / (exchange.ep * exchange.local_experts))
        return Routed([[per_cell] * exchange.local_experts for _ in range(exchange.ep)])

    return rule


def measured(calls: Sequence[dict[str, Any]]) -> CountRule:
    """A rule for traces: a run's step, dispatch by dispatch (`RoutingLog.calls`: every MoE layer of every
    micro-step, in order, each `{"received": ..., "sent": ...}`), replayed in that order, again each step; a
    checkpointed block's recomputation gets what its forward got."""
    done = [0]
    last: dict[int, Routed] = {}

    def rule(_sent: torch.Tensor, exchange: Exchange, _group: Any) -> Routed:
        if exchange.recomputing and exchange.layer in last:
            return last[exchange.layer]
        call = calls[done[0] % len(calls)]
        last[exchange.layer] = Routed([list(r) for r in call["received"]], list(call["sent"]))
        done[0] += 1
        return last[exchange.layer]

    return rule


def rule_from(routing: dict[str, Any] | None) -> CountRule | None:
    """The rule a rank-trace request names (`{"imbalance": factor}` or `{"calls": RoutingLog.calls}`), or
    None (the exchange as it runs: its values are the fake group's garbage)."""
    if not routing:
        return None
    if "imbalance" in routing:
        return imbalanced(float(routing["imbalance"]))
    return measured(routing["calls"])


_RULE: list[CountRule] = [exchange_counts]


@contextlib.contextmanager
def counts_from(rule: CountRule) -> Iterator[None]:
    """Dispatches inside take the rows each rank receives from `rule` instead of exchanging them."""
    _RULE.append(rule)
    try:
        yield
    finally:
        _RULE.pop()


@dataclass
class RoutingLog:
    """What this rank's dispatches routed since the last `take` (forwards only, not a checkpointed block's
    recomputation): per layer, the rows it sent each expert (global ids) and the counts it last received."""

    sent: dict[int, list[int]] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)  # each dispatch's counts, in order (`measured`)
    received_rows: int = 0

    def add(self, layer: int, sent: list[int], received: list[list[int]], send_sizes: list[int]) -> None:
        old = self.sent.get(layer, [0] * len(sent))
        self.sent[layer] = [a + b for a, b in zip(old, sent, strict=True)]
        self.calls.append({"received": received, "sent": send_sizes})
        self.received_rows += sum(map(sum, received))

    def take(self) -> RoutingLog:
        taken = RoutingLog(self.sent, self.calls, self.received_rows)
        self.sent, self.calls, self.received_rows = {}, [], 0
        return taken


ROUTING = RoutingLog()
LAST_STEP: list[
    RoutingLog
] = []  # the last step's log, once `routing_row` took it (a trace replays its calls)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; its backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any) -> Any:
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = rows.new_empty((sum(out_sizes), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        out_sizes, in_sizes = ctx.sizes
        return _AllToAll.apply(grad.contiguous(), in_sizes, out_sizes, ctx.group), None, None, None


def expert_meshes(env: DistEnv) -> tuple[DeviceMesh, DeviceMesh]:
    """(the `ep` mesh, the mesh FSDP2 shards the experts over: the shard ranks outside ep, with the replicas
    first under HSDP), slices of the run's one `DeviceMesh` with `dp_shard` unflattened."""
    mesh = env.device_mesh
    assert mesh is not None, "apply_strategies builds the run's device mesh"
    shape = env.shape
    if id(mesh) not in _SPLIT:  # one unflattening per mesh (it creates the process groups)
        _SPLIT[id(mesh)] = mesh._unflatten(
            "dp_shard", (shape.expert_shards, shape.ep), ("dp_shard_outside_ep", "ep")
        )
    split = _SPLIT[id(mesh)]
    if shape.dp_replicate > 1:
        return split["ep"], split["dp_replicate", "dp_shard_outside_ep"]
    return split["ep"], split["dp_shard_outside_ep"]


_SPLIT: dict[int, DeviceMesh] = {}


def apply_expert_parallel(layers: list[ExpertLayer] | None, env: DistEnv, owner: str) -> None:
    """Split each layer's experts over `ep` (DTensor `Shard(0)`) and route its tokens by all-to-all;
    `Unsupported` naming `strategies.mesh.ep` without a plan (`owner`: the trainer) or when ep does not
    divide a layer's experts."""
    ep = env.shape.ep
    if not layers:
        raise Unsupported(
            f"strategies.mesh.ep: {owner} has no expert-parallel plan (override "
            "Trainer.expert_parallel_plan(model)); set strategies.mesh.ep: 1"
        )
    from torch.distributed.tensor import Shard, distribute_tensor

    ep_mesh, _ = expert_meshes(env)
    for index, layer in enumerate(layers):
        if layer.num_experts % ep:
            raise Unsupported(
                f"strategies.mesh.ep: {ep} ranks do not divide a layer's {layer.num_experts} experts; "
                "choose an ep that divides them"
            )
        module = layer.module
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] != layer.num_experts:
                raise Unsupported(
                    f"strategies.mesh.ep: {type(module).__name__}.{name} is not stacked over the "
                    f"{layer.num_experts} experts on dim 0; set strategies.mesh.ep: 1"
                )
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module._parameters[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        module._memtrain_experts = True  # type: ignore[assignment]  # FSDP2 shards it outside ep
        module.forward = _dispatcher(layer, index, ep_mesh)  # type: ignore[method-assign]


def is_experts(module: nn.Module) -> bool:
    """A module `apply_expert_parallel` split (FSDP2 shards it over the ranks outside ep)."""
    return bool(getattr(module, "_memtrain_experts", False))


def _dispatcher(layer: ExpertLayer, index: int, ep_mesh: DeviceMesh) -> Callable[..., torch.Tensor]:
    group, ep, ep_rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
    local = layer.num_experts // ep

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        again = torch._C._current_graph_task_id() != -1
        exchange = Exchange(top_k_index.numel(), ep, local, index, ep_rank, 1.0 / ep, again)
        return dispatch(layer, hidden, top_k_index, top_k_weights, exchange, group)

    return forward


def dispatch(
    layer: ExpertLayer,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    exchange: Exchange,
    group: Any,
) -> torch.Tensor:
    """One MoE layer's experts over the ep ranks (the module docstring's steps 1-5)."""
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    permuted = hidden[order // k]
    sent = torch.zeros(layer.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    routed = _RULE[-1](sent.view(exchange.ep, exchange.local_experts), exchange, group)
    received = routed.received
    send_sizes = _send_sizes(sent.view(exchange.ep, exchange.local_experts), exchange)
    if routed.sent is not None and sum(routed.sent) == exchange.rows:  # not a measured step of other rows
        send_sizes = routed.sent
    recv_sizes = [sum(row) for row in received]
    if not exchange.recomputing:
        ROUTING.add(exchange.layer, [int(v) for v in sent.tolist()], received, send_sizes)
    arrived = _AllToAll.apply(permuted, recv_sizes, send_sizes, group)
    by_expert, pieces = _regroup(arrived, received)
    with _local_parameters(layer.module, exchange.grad_scale):
        out = layer.run_local(layer.module, by_expert, [sum(c) for c in zip(*received, strict=True)])
        if (
            out.shape[0] == 0
        ):  # no rows here: keep the experts in the graph (FSDP2 reduces every rank's grads)
            out = out + sum(p.sum() * 0 for p in layer.module._parameters.values() if p is not None)
    back = _AllToAll.apply(_ungroup(out, pieces, received), send_sizes, recv_sizes, group)
    unpermuted = back[torch.argsort(order)]
    weights = top_k_weights.to(unpermuted.dtype).unsqueeze(-1)
    return (unpermuted.view(tokens, k, -1) * weights).sum(dim=1).to(hidden.dtype)


def _send_sizes(sent: torch.Tensor, exchange: Exchange) -> list[int]:
    """Rows sent to each ep rank; under the rank trace's fake tensors, whose counts read as placeholders
    (they do not add up to the T·k rows), an even split (the buffers' sizes do not depend on it)."""
    sizes = [int(v) for v in sent.sum(dim=1).tolist()]
    if sum(sizes) == exchange.rows:
        return sizes
    return [exchange.rows // exchange.ep + (r < exchange.rows % exchange.ep) for r in range(exchange.ep)]


def _regroup(arrived: torch.Tensor, received: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """Rows that arrived ordered (source, expert) reordered (expert, source); each piece's offset."""
    offsets: list[list[int]] = []
    start = 0
    for row in received:
        offsets.append([])
        for count in row:
            offsets[-1].append(start)
            start += count
    pieces = [
        arrived[offsets[s][e] : offsets[s][e] + received[s][e]]
        for e in range(len(received[0]))
        for s in range(len(received))
    ]
    return (torch.cat(pieces) if pieces else arrived), offsets


def _ungroup(out: torch.Tensor, offsets: list[list[int]], received: list[list[int]]) -> torch.Tensor:
    """The inverse of `_regroup`: (expert, source) back to (source, expert)."""
    sources, experts = len(received), len(received[0])
    starts, start = {}, 0
    for e in range(experts):
        for s in range(sources):
            starts[(s, e)] = start
            start += received[s][e]
    pieces = [
        out[starts[(s, e)] : starts[(s, e)] + received[s][e]] for s in range(sources) for e in range(experts)
    ]
    return torch.cat(pieces) if pieces else out


class _ScaleGrad(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad * ctx.scale, None


@contextlib.contextmanager
def _local_parameters(module: nn.Module, grad_scale: float) -> Iterator[None]:
    """The module's DTensor parameters as their local tensors (differentiably, the gradient scaled by
    `grad_scale`) for the local experts' run."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if param is not None and hasattr(param, "to_local"):
                module._parameters[name] = _ScaleGrad.apply(param.to_local(), grad_scale)  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(saved)


def grouped_forward(module: nn.Module, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`run_local` for a transformers MoE family's experts module: its own forward, each row sent to its
    local expert with weight 1 (the family's experts count set to the local one when the plan is built)."""
    ids = torch.repeat_interleave(
        torch.arange(len(counts), device=rows.device), torch.tensor(counts, device=rows.device)
    )
    ones = rows.new_ones((rows.shape[0], 1))
    original = type(module).forward
    return original(module, rows, ids.unsqueeze(-1), ones)


def routing_row(env: DistEnv) -> dict[str, Any]:
    """The metrics row's routing numbers for the step just done (collectives over every rank: each must
    call it): the rows each rank's experts received, and per MoE layer the busiest expert's load over the
    mean, over the global routing."""
    log = ROUTING.take()
    LAST_STEP[:] = [log]
    if env.shape.ep == 1 or not log.sent:
        return {}
    layers = sorted(log.sent)
    load = torch.tensor([log.sent[layer] for layer in layers], dtype=torch.float64, device=env.device)
    received = torch.zeros(env.world_size, dtype=torch.float64, device=env.device)
    received[env.rank] = log.received_rows
    if env.distributed:
        dist.all_reduce(load)
        dist.all_reduce(received)
    mean = load.mean(dim=1).clamp(min=1e-12)
    ratios = (load.max(dim=1).values / mean).tolist()
    return {
        "ep_rows_per_rank": [int(v) for v in received.tolist()],
        "ep_load_max_over_mean": [round(float(r), 4) for r in ratios],
    }
