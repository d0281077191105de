"""`MeshShape`: how the ranks of a run are arranged, the degrees of each kind of parallelism.

Why one small object: the recipe names the degrees (`strategies.mesh`), the plan records them, the data
reads which data-parallel rank a process is, the sharding backends and tensor parallelism build their
`DeviceMesh` from them and the planner divides memory by them. Each of those reads this one arrangement,
so none of them can disagree on which rank holds what.

Dimensions, outermost (slowest link, between nodes) to innermost (fastest, within a node), as torchtitan
orders them: `pp` (pipeline stages), `dp_replicate` (HSDP's replicas), `dp_shard` (FSDP's shard group),
`cp` (context parallel), `tp` (tensor parallel). Rank r's coordinate on each dimension is the digit of r
in that mixed radix (tp fastest). The data-parallel ranks are replicas x shards: each reads its own samples,
and the tensor, context and pipeline ranks of one data-parallel rank read the same ones.

`ep` (expert parallelism) is not a factor of the world size: as in torchtitan it borrows ranks from the
FSDP shard group. The experts of a mixture-of-experts layer are split over `ep` consecutive `dp_shard`
ranks, which send each token to its expert's rank and back (all-to-all); every other weight is sharded over
the whole shard group as before. So `ep` divides `dp_shard`, and `dp_shard // ep` ranks share each expert.

A recipe gives each degree as an int or `auto`. `resolve` fills the autos from the world size: one auto
takes the ranks the pinned degrees leave (`dp_shard` first, then `dp_replicate`, `tp`, `cp`, `pp`) and the
others are 1. `dp_shard: auto` with the rest 1 is the default, so a recipe that never names a mesh is 1-D
data parallelism, as before meshes. Nothing here
imports torch.distributed: building the `DeviceMesh` is `memtrain.distributed.device_mesh`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimensions, outermost first (the order of `init_device_mesh`'s shape)."""
TAKES_THE_REST = ("dp_shard", "dp_replicate", "tp", "cp", "pp")
"""Which open (`auto`) degree takes the ranks the pinned ones leave, first match."""
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
"""Pipeline schedules a recipe may name (`strategies.mesh.pp_schedule`)."""


@dataclass(frozen=True)
class MeshShape:
    """Degrees of each dimension (their product is the world size), whether tensor parallelism also
    shards the sequence between its matmuls (`sequence_parallel`, Korthikanti et al. 2022) and the order in
    which pipeline stages run their micro-batches (`pp_schedule`, one of `PP_SCHEDULES`)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = True
    pp_schedule: str = "1f1b"
    ep: int = 1

    def __post_init__(self) -> None:
        if self.dp_shard % self.ep:
            raise ValueError(
                f"strategies.mesh.ep: {self.ep} expert-parallel ranks do not divide the shard group "
                f"(dp_shard {self.dp_shard}); choose an ep that divides it"
            )

    @property
    def expert_shards(self) -> int:
        """Ranks that share each expert (FSDP over the shard group outside expert parallelism)."""
        return self.dp_shard // self.ep

    @classmethod
    def flat(cls, world_size: int) -> MeshShape:
        """One data-parallel dimension over every rank (a recipe without a mesh)."""
        return cls(dp_shard=world_size)

    @property
    def degrees(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in DIMS)

    @property
    def size(self) -> int:
        return math.prod(self.degrees)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (replicas x shards): how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def batch_copies(self) -> int:
        """Ranks that read the same batch rows (the tensor and pipeline ranks of one data-parallel rank);
        context-parallel ranks read the same rows but different tokens of them."""
        return self.tp * self.pp

    @property
    def is_flat(self) -> bool:
        """Only data parallelism, on one dimension: what memtrain ran before meshes."""
        return self.dp_replicate == 1 and self.tp == self.pp == self.cp == self.ep == 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s index on each dimension."""
        found = {}
        for dim in reversed(DIMS):
            degree = getattr(self, dim)
            found[dim] = rank % degree
            rank //= degree
        return {dim: found[dim] for dim in DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel rank (0 .. dp_size - 1) process `rank` is: the samples it reads."""
        where = self.coordinates(rank)
        return where["dp_replicate"] * self.dp_shard + where["dp_shard"]

    def state_ranks(self, shards_within_replica: bool) -> int:
        """The ranks a sharding's state arithmetic counts (`ShardingBackend.state_bytes`' world size): the
        shard group for a sharding that reduce-scatters gradients (zero2/zero3: HSDP keeps a whole copy per
        replica), every data-parallel rank for the others (zero1 shards its optimizer over all of them; none
        and ddp only ask whether there are several). Tensor parallelism divides the matmul states further; until the planner models it
        ("Plan the mesh") they are counted undivided: an over-prediction, never an under-one."""
        return self.dp_shard if shards_within_replica else self.dp_size

    def crossing(self, ranks_per_node: int) -> list[str]:
        """The dimensions whose groups span several nodes when consecutive ranks share a node (torchrun's
        order): a dimension stays within a node when its group's span (its degree times the degrees inside
        it) divides the ranks per node."""
        inner, found = 1, []
        for dim in reversed(DIMS):
            degree = getattr(self, dim)
            span = inner * degree
            if degree > 1 and (span > ranks_per_node or ranks_per_node % span):
                found.append(dim)
            inner = span
        return list(reversed(found))

    def describe(self) -> str:
        """E.g. `dp_replicate 2 x dp_shard 2 x tp 2 (sequence parallel)`; `dp 4` for a flat mesh."""
        if self.is_flat and self.ep == 1:
            return f"dp {self.dp_shard}"
        named = " x ".join(f"{dim} {getattr(self, dim)}" for dim in DIMS if getattr(self, dim) > 1)
        named += f" (ep {self.ep})" if self.ep > 1 else ""
        notes = ["sequence parallel"] if self.tp > 1 and self.sequence_parallel else []
        notes += [self.pp_schedule] if self.pp > 1 else []
        return (named or "1 rank") + (f" ({', '.join(notes)})" if notes else "")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshShape:
        """The inverse of `to_dict` (plan.json, checkpoint metadata); `ValueError` for anything else."""
        known = {f.name for f in fields(cls)}
        if not isinstance(data, Mapping) or set(data) - known:
            raise ValueError(f"not a mesh: {data!r}")
        values = {k: v for k, v in data.items()}
        for dim in (*DIMS, "ep"):
            if dim in values and not (isinstance(values[dim], int) and values[dim] >= 1):
                raise ValueError(f"mesh degree {dim} must be a positive int (it was {values[dim]!r})")
        if not isinstance(values.get("sequence_parallel", True), bool):
            raise ValueError("mesh sequence_parallel must be true or false")
        if values.get("pp_schedule", "1f1b") not in PP_SCHEDULES:
            raise ValueError(f"mesh pp_schedule must be one of {', '.join(PP_SCHEDULES)}")
        return cls(**values)


def resolve(
    degrees: Mapping[str, int | str],
    world_size: int,
    sequence_parallel: bool = True,
    pp_schedule: str = "1f1b",
    ep: int = 1,
) -> MeshShape:
    """The mesh of `world_size` ranks that `degrees` (each an int or `auto`) describes, with `ep` expert-
    parallel ranks in its shard group; `ValueError` naming the key when the degrees cannot multiply to the
    world size or `ep` does not divide the shard group."""
    pinned = {dim: int(v) for dim, v in degrees.items() if v != "auto"}
    open_dims = [dim for dim in DIMS if degrees.get(dim, 1) == "auto"]
    product = math.prod(pinned.values())
    if world_size % product:
        given = " x ".join(f"{d} {v}" for d, v in pinned.items() if v > 1) or "1"
        raise ValueError(
            f"strategies.mesh: the pinned degrees ({given} = {product}) do not divide the world size "
            f"{world_size}; change them or set one to auto"
        )
    rest = world_size // product
    filled = dict.fromkeys(open_dims, 1)
    if rest > 1:
        if not open_dims:
            given = " x ".join(f"{d} {v}" for d, v in pinned.items() if v > 1) or "1"
            raise ValueError(
                f"strategies.mesh: the degrees multiply to {product} ({given}) but the world size is "
                f"{world_size}; set strategies.mesh.dp_shard: auto or make the product {world_size}"
            )
        filled[next(dim for dim in TAKES_THE_REST if dim in open_dims)] = rest
    values = {dim: pinned.get(dim, filled.get(dim, 1)) for dim in DIMS}
    return MeshShape(**values, sequence_parallel=sequence_parallel, pp_schedule=pp_schedule, ep=ep)
