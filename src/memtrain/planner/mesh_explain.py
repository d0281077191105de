"""What the mesh search decided: a table for a person, `--json` for a program.

Why the runners-up are one row per mesh and the misfit is a mesh: at scale the question is "which
arrangement of my GPUs", so each mesh shows its fastest plan that fits; the fastest mesh that does not fit
says how many GiB it is short, which is what a person weighs against more nodes or another recipe.
"""

from __future__ import annotations

from typing import Any

from memtrain.memory.footprint import COMPONENTS
from memtrain.planner.explain import budget_line
from memtrain.planner.mesh_cost import EXPERT_SOURCE, SOURCES
from memtrain.planner.mesh_search import MeshResult, MeshScored

RUNNERS_UP = 5
GiB = 2**30


def best_per_mesh(rows: tuple[MeshScored, ...]) -> list[MeshScored]:
    """The first (fastest) row of each mesh, in order."""
    seen: set[tuple[Any, ...]] = set()
    found = []
    for row in rows:
        key = (row.mesh.degrees, row.mesh.ep, row.mesh.sequence_parallel, row.mesh.pp_schedule)
        if key not in seen:
            seen.add(key)
            found.append(row)
    return found


def describe_meshes(result: MeshResult, title: str) -> str:
    cluster, target = result.cluster, result.target
    lines = [
        title,
        budget_line(target.budget),
        f"cluster: {cluster.nodes(target.world_size)} node(s) x {cluster.gpus_per_node} GPUs; within a node "
        f"{cluster.within.bandwidth / 1e9:.3g} GB/s, between nodes {cluster.between.bandwidth / 1e9:.3g} GB/s "
        f"per GPU; {len(result.excluded)} meshes ruled out, searched in {result.seconds:.1f} s",
    ]
    lines += [f"note: {note}" for note in result.notes]
    chosen = result.chosen
    if chosen is None:
        lines.append("no mesh fits")
    else:
        lines += [
            "",
            f"chosen: mesh {chosen.mesh.describe()}, {chosen.scored.plan.describe()}",
            *_detail(result, chosen),
        ]
    rows = best_per_mesh(result.ranked)
    lines += [
        "",
        f"   #  {'mesh':44} {'crosses nodes':14} {'plan':34} {'peak':>10} {'reserved':>10} {'tok/s/GPU':>10}",
    ]
    lines += [_row(i + 1, r, result) for i, r in enumerate(rows[:RUNNERS_UP])]
    if len(rows) > RUNNERS_UP:
        lines.append(f"  ... {len(rows) - RUNNERS_UP} more meshes fit")
    misfit = result.best_misfit
    if misfit is not None:
        short = (misfit.required - target.budget.usable) / GiB
        lines += [
            "",
            f"fastest mesh that does not fit: {misfit.mesh.describe()}, {misfit.scored.plan.describe()}: peak "
            f"{misfit.peak / GiB:.2f} GiB, {short:.2f} GiB short, {misfit.tokens_per_second:,.0f} tokens/s per GPU",
        ]
    return "\n".join(lines)


def meshes_to_json(result: MeshResult) -> dict[str, Any]:
    """The `memtrain plan --json` document of a mesh search (bytes as integers, seconds as floats)."""
    usable = result.target.budget.usable
    return {
        "world_size": result.target.world_size,
        "budget": result.target.budget.to_dict(),
        "cluster": {
            "gpus_per_node": result.cluster.gpus_per_node,
            "nodes": result.cluster.nodes(result.target.world_size),
            "within_node_bandwidth": result.cluster.within.bandwidth,
            "between_nodes_bandwidth": result.cluster.between.bandwidth,
        },
        "sources": SOURCES | (EXPERT_SOURCE if _routed(result) else {}),
        "notes": list(result.notes),
        "chosen": _mesh_json(result.chosen, result, usable) if result.chosen is not None else None,
        "meshes": [_mesh_json(r, result, usable) for r in best_per_mesh(result.ranked)],
        "fastest_misfit": _mesh_json(result.best_misfit, result, usable) if result.best_misfit else None,
        "excluded": [{"mesh": mesh, "why": why} for mesh, why in result.excluded],
        "search_seconds": result.seconds,
    }


def _mesh_json(row: MeshScored, result: MeshResult, usable: int) -> dict[str, Any]:
    cost = row.cost
    return {
        "mesh": row.mesh.to_dict(),
        "crosses_nodes": row.mesh.crossing(result.cluster.gpus_per_node),
        "plan": row.scored.plan.summary(),
        "predicted": cost.footprint.to_dict(),
        "predicted_reserved": row.reserved,
        "fits": row.required <= usable,
        "short_bytes": max(0, row.required - usable),
        "step_seconds": cost.step_seconds,
        "compute_seconds": cost.compute_seconds,
        "pipeline_bubble_seconds": cost.bubble_seconds,
        "exposed_communication_seconds": cost.exposed,
        "tokens_per_second_per_gpu": row.tokens_per_second,
        **({"experts": cost.experts.to_dict()} if cost.experts is not None else {}),
    }


def _detail(result: MeshResult, row: MeshScored) -> list[str]:
    footprint, cost = row.cost.footprint, row.cost
    parts = "  ".join(f"{name} {getattr(footprint, name) / GiB:.2f} GiB" for name in COMPONENTS)
    exposed = ", ".join(f"{dim} {s:.3f} s" for dim, s in cost.exposed.items()) or "none"
    crossing = ", ".join(row.mesh.crossing(result.cluster.gpus_per_node)) or "none"
    return [
        f"  busiest rank: {parts}",
        f"  peak {row.peak / GiB:.2f} GiB allocated, {_gib(row.reserved)} reserved, of "
        f"{result.target.budget.usable / GiB:.2f} GiB usable; step "
        f"{cost.step_seconds:.2f} s (compute {cost.compute_seconds:.2f} s, pipeline bubble "
        f"{cost.bubble_seconds:.2f} s), {row.tokens_per_second:,.0f} tokens/s per GPU",
        f"  dimensions crossing nodes: {crossing}; exposed communication per step: {exposed}",
        *_routed_load(row),
    ]


def _routed(result: MeshResult) -> bool:
    """Whether the job routes tokens to experts (its rows carry a routed load)."""
    rows = (*result.ranked, *((result.best_misfit,) if result.best_misfit else ()))
    return any(row.cost.experts is not None for row in rows)


def _routed_load(row: MeshScored) -> list[str]:
    """The load the busiest ep rank was planned for, and what more imbalance would cost it."""
    experts = row.cost.experts
    if experts is None:
        return []
    load = experts.load
    rows = f"{load.rows:,} routed rows per MoE layer and micro-step (mean {load.mean_rows:,} = {load.tokens:,} tokens x top-{load.top_k})"
    if load.capacity_factor is not None:
        return [
            f"  routed load: capacity factor {load.capacity_factor:g} (strategies.moe.capacity_factor): every "
            f"rank runs {rows}, padded to capacity whatever the routing"
        ]
    if load.ep == 1:
        return [
            f"  routed load: ep 1, each rank runs its own {rows}; strategies.moe.max_load applies from ep 2"
        ]
    return [
        f"  routed load: the busiest of {load.ep} ep ranks at {load.load:.2f} x the mean (strategies.moe.max_load "
        f"{load.max_load:g}): {rows}; each 0.5 more of imbalance costs {experts.per_half_load / GiB:.2f} GiB per rank"
    ]


def _row(index: int, row: MeshScored, result: MeshResult) -> str:
    crossing = ",".join(row.mesh.crossing(result.cluster.gpus_per_node)) or "-"
    plan = row.scored.plan
    label = f"{plan.precision.name} {plan.checkpointing.describe()} {plan.sharding.describe()} {plan.micro_batch_size}x{plan.accumulation_steps}"
    return (
        f"  {index:>2}  {row.mesh.describe():44.44} {crossing:14.14} {label:34.34} "
        f"{row.peak / GiB:>6.2f} GiB {_gib(row.reserved):>10} {row.tokens_per_second:>10,.0f}"
    )


def _gib(n: int | None) -> str:
    return f"{n / GiB:.2f} GiB" if n is not None else "-"
