"""The mesh search: every arrangement of N GPUs the recipe leaves open, each with every plan, ranked by
predicted tokens/s per GPU.

Why here and how: `strategies.mesh` names each degree or leaves it `auto`; the degrees left open are
searched over every factorisation of what the pinned ones leave, under the constraints a mesh must meet
(`mesh_constraints`: tensor parallelism within a node and dividing the model's heads, KV heads,
intermediate and vocabulary sizes, the sequence divisible by t x 2c, the pipeline dividing the blocks, the
global batch dividing over the data-parallel ranks). For each mesh, the plans (precision, recompute,
sharding, micro-batches, ...) are scored on its data-parallel dimensions by the one-device search
(`search.score_candidates`, cached per (replicas, shards)), and `mesh_cost` divides them by the tensor,
context and pipeline degrees and adds the communication of each dimension over the link it crosses
(`memtrain.cluster`). The order is total (tokens/s, then peak, then the mesh and the plan), so every rerun
picks the same mesh.

A degree the recipe pins is planned even where this version cannot run it yet (context parallelism, a
pipeline with tensor parallelism, interleaved 1F1B): `MeshResult.notes` says so, the table prints it. An
open degree never chooses such a mesh, except an open `ep` in a what-if (the question is what expert
parallelism would give; its runtime is built separately): noted the same way.

`ep` (a mixture of experts' expert parallelism, expert_parallel.py) is not a factor of the world: each mesh
is scored once on its data-parallel dimensions, then at every ep dividing both its shard group and the
experts count (`strategies.mesh.ep: auto`), under FSDP2 plans, the busiest rank at its routed load.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from memtrain.cluster import Cluster
from memtrain.errors import PlanError, RecipeError, Unsupported
from memtrain.memory.headroom import Target
from memtrain.mesh import DIMS, MeshShape
from memtrain.plan import mesh_problems, per_rank_batch
from memtrain.planner.cost import CostModel
from memtrain.planner.expert_parallel import MoePlanning, ep_degrees
from memtrain.planner.explain import RUNNERS_UP
from memtrain.planner.memory_model import required_bytes
from memtrain.planner.mesh_cost import MeshCost, activation_share, mesh_cost
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.prediction_error import reserved_margin
from memtrain.planner.reserved import ReservedModel, expandable_in_effect
from memtrain.planner.result import Scored
from memtrain.planner.search import Evaluation, Scoring, score_candidates
from memtrain.recipe import Recipe

UNBOUNDED = 2**62  # the budget plans are scored with before the mesh divides them
ProbeFor = Callable[[int], ModelProbe]  # context-parallel degree -> the model probed at seq_len / cp
TensorParallelProblems = Callable[[int], list[str]] | None  # ModelSpec.tensor_parallel_problems


@dataclass(frozen=True)
class MeshScored:
    """One plan on one mesh: what the busiest rank holds, the step, tokens/s per GPU."""

    mesh: MeshShape
    scored: Scored  # the plan on the mesh's data-parallel dimensions alone
    cost: MeshCost
    tokens_per_second: float  # per GPU

    reserved: int | None = (
        None  # the CUDA caching allocator's segments (see `_with_reserved`); None: not replayed
    )
    margin: float = 0.0  # planner.reserved_margin

    @property
    def peak(self) -> int:
        return self.cost.peak

    @property
    def required(self) -> int:
        """What must fit: the peak, or the reserved bytes with their margin when replayed."""
        return required_bytes(self.peak, self.reserved, self.margin)

    def order(self) -> tuple[Any, ...]:
        plan = self.scored.plan  # equal speed and memory: eager before compiled (as `Scored.order`)
        return (
            -round(self.tokens_per_second, 6),
            self.peak,
            (*self.mesh.degrees, self.mesh.ep),
            plan.compile.compiled,
            plan.key(),
        )


@dataclass(frozen=True)
class MeshResult:
    """Every scored (mesh, plan) that fits, fastest first; the fastest that does not; what was left out."""

    target: Target
    cluster: Cluster
    ranked: tuple[MeshScored, ...]
    best_misfit: MeshScored | None
    excluded: tuple[tuple[str, str], ...]  # (mesh, why it was not scored)
    notes: tuple[str, ...]  # what this version cannot run of a pinned mesh
    seconds: float  # how long the search took

    @property
    def chosen(self) -> MeshScored | None:
        return self.ranked[0] if self.ranked else None


def open_dims(recipe: Recipe) -> list[str]:
    """The mesh degrees the recipe leaves to the planner (`auto`)."""
    config = recipe.strategies.mesh
    return [dim for dim in DIMS if getattr(config, dim) == "auto"]


def searches_meshes(recipe: Recipe, what_if: bool) -> bool:
    """Whether `memtrain plan` runs the mesh search: a degree other than dp_shard is open, or (for hardware that
    is not here) the recipe pins a mesh of more than one data-parallel dimension. A pinned mesh planned for
    this machine goes to the search a run makes, which traces each rank on this CPU (rank_trace.py)."""
    config = recipe.strategies.mesh
    if set(open_dims(recipe)) - {"dp_shard"} or config.ep == "auto":
        return True
    return what_if and any(getattr(config, dim) != 1 for dim in (*DIMS, "ep") if dim != "dp_shard")


def candidate_meshes(recipe: Recipe, world_size: int) -> Iterator[MeshShape]:
    """Every mesh of `world_size` ranks with the recipe's pinned degrees, the open ones any factorisation."""
    config = recipe.strategies.mesh
    pinned = {dim: int(getattr(config, dim)) for dim in DIMS if getattr(config, dim) != "auto"}
    rest, remainder = divmod(world_size, math.prod(pinned.values()))
    if remainder:
        raise RecipeError(
            [f"strategies.mesh: the pinned degrees ({pinned}) do not divide the world size {world_size}"]
        )
    dims = open_dims(recipe)
    if not dims:
        if rest != 1:
            raise RecipeError(
                [f"strategies.mesh: the degrees multiply to {world_size // rest}, not {world_size}"]
            )
        yield _shape(pinned, recipe)
        return
    divisors = [k for k in range(1, rest + 1) if rest % k == 0]
    for values in itertools.product(divisors, repeat=len(dims) - 1):
        last, remainder = divmod(rest, math.prod(values))
        if not remainder:
            yield _shape({**pinned, **dict(zip(dims, (*values, last), strict=True))}, recipe)


def mesh_constraints(
    mesh: MeshShape,
    recipe: Recipe,
    *,
    cluster: Cluster,
    num_blocks: int,
    seq_len: int,
    tensor_parallel_problems: TensorParallelProblems,
    pipeline: bool,
) -> list[str]:
    """Why `mesh` cannot run the recipe's job (empty when it can). Tensor parallelism within a node and
    the pipeline dividing the blocks are asked of open degrees only (a pinned degree is the user's call)."""
    opened = set(open_dims(recipe))
    problems: list[str] = []
    if mesh.tp > 1:
        if tensor_parallel_problems is None:
            problems.append("strategies.mesh.tp: the trainer has no tensor_parallel_plan")
        else:
            problems += tensor_parallel_problems(mesh.tp)
        if "tp" in opened and cluster.gpus_per_node % mesh.tp:
            problems.append(f"tp {mesh.tp} does not fit within a node of {cluster.gpus_per_node} GPUs")
    if mesh.pp > 1 and not pipeline:
        problems.append("strategies.mesh.pp: the trainer cannot split its model into pipeline stages")
    elif 1 < mesh.pp and num_blocks < mesh.pp:
        problems.append(f"pp {mesh.pp}: the model has {num_blocks} blocks, fewer than the stages")
    elif "pp" in opened and num_blocks % mesh.pp:
        problems.append(f"pp {mesh.pp} does not divide the model's {num_blocks} blocks")
    split = (mesh.tp if mesh.sequence_parallel else 1) * (2 * mesh.cp if mesh.cp > 1 else 1)
    if seq_len % split:
        problems.append(f"the sequence ({seq_len} tokens) is not divisible by tp x 2cp = {split}")
    try:
        per_rank_batch(recipe, mesh.dp_size)
    except RecipeError as exc:
        problems += exc.problems
    if opened - {"dp_shard"}:
        problems += mesh_problems(mesh, "cuda")
    return problems


def search_meshes(
    recipe: Recipe,
    probe_for: ProbeFor,
    target: Target,
    cluster: Cluster,
    device: torch.device,
    *,
    tensor_parallel_problems: TensorParallelProblems,
    pipeline: bool,
    cost: CostModel | None = None,
) -> MeshResult:
    """Score every (mesh, plan) of the recipe on `target` (its world size, budget and device); `PlanError`
    naming the keys when no mesh can run the job."""
    started, cpu = time.perf_counter(), time.process_time()
    base = probe_for(1)
    full_seq = base.seq_len
    scorings: dict[tuple[int, int, int], Scoring | str] = {}
    excluded: list[tuple[str, str]] = []
    notes: set[str] = set()
    found: list[MeshScored] = []
    owners: dict[int, Evaluation] = {}  # each scored plan's evaluation (its traces, for the reserved replay)
    rows = recipe.batch.global_size
    moe = moe_planning(recipe, base)
    for mesh in candidate_meshes(recipe, target.world_size):
        problems = mesh_constraints(
            mesh,
            recipe,
            cluster=cluster,
            num_blocks=base.num_blocks,
            seq_len=full_seq,
            tensor_parallel_problems=tensor_parallel_problems,
            pipeline=pipeline,
        )
        degrees_or_why = expert_parallel_degrees(recipe, mesh, moe)
        problems += [degrees_or_why] if isinstance(degrees_or_why, str) else []
        degrees = [] if isinstance(degrees_or_why, str) else degrees_or_why
        if problems:
            excluded.append((mesh.describe(), "; ".join(problems)))
            continue
        notes.update(mesh_problems(mesh, "cuda"))
        key = (mesh.dp_replicate, mesh.dp_shard, mesh.cp)
        if key not in scorings:
            try:
                scorings[key] = _score_data_parallel(recipe, probe_for(mesh.cp), target, mesh, device, cost)
            except (RecipeError, PlanError, Unsupported) as exc:  # pinned strategies cannot run here
                scorings[key] = str(exc)
        scoring = scorings[key]
        if isinstance(scoring, str):
            excluded.append((mesh.describe(), scoring))
            continue
        probe = scoring.evaluation.probe
        for ep in degrees:
            on_ep = replace(mesh, ep=ep)
            cannot_run = mesh_problems(on_ep, "cuda")
            if cannot_run and not target.what_if and recipe.strategies.mesh.ep == "auto":
                continue  # a run's open ep never chooses what this version cannot run
            notes.update(cannot_run)
            for scored in scoring.scored:
                if ep > 1 and not _expert_fsdp(scored):
                    continue
                owners[id(scored)] = scoring.evaluation
                found.append(
                    _on_mesh(scored, on_ep, scoring.evaluation, probe, cluster, rows * full_seq, moe)
                )
    if not found:
        reasons = "\n".join(f"  {mesh}: {why}" for mesh, why in excluded) or "  (no candidate)"
        raise PlanError(f"no mesh of {target.world_size} ranks can run this job:\n{reasons}")
    usable = target.budget.usable
    meshes = len({row.mesh.degrees for row in found})
    base.progress(
        f"scored {len(found)} plans on {meshes} meshes ({len(scorings)} data-parallel arrangements) in "
        f"{time.process_time() - cpu:.1f} s of CPU"
    )
    if target.device_type == "cuda":
        cpu = time.process_time()
        found = _with_reserved(found, recipe, target, base.num_blocks, owners)
        base.progress(f"reserved bytes of the fastest meshes in {time.process_time() - cpu:.1f} s of CPU")
    ranked = tuple(sorted((f for f in found if f.required <= usable), key=MeshScored.order))
    misfits = sorted((f for f in found if f.required > usable), key=MeshScored.order)
    return MeshResult(
        target=target,
        cluster=cluster,
        ranked=ranked,
        best_misfit=misfits[0] if misfits else None,
        excluded=tuple(excluded),
        notes=tuple(sorted(notes)),
        seconds=time.perf_counter() - started,
    )


def _with_reserved(
    found: list[MeshScored], recipe: Recipe, target: Target, num_blocks: int, owners: dict[int, Evaluation]
) -> list[MeshScored]:
    """Reserved bytes for the fastest rows whose peak fits, until the chosen mesh and its runners-up fit by
    them (a replay costs a fraction of a second: the rows after those keep their peak). A row's reserved
    bytes are its peak plus the allocator's overhead over its data-parallel plan's traced step (reserved.py),
    divided as the tensor ranks divide that step's activations (formula)."""
    model = ReservedModel(
        num_blocks, expandable_in_effect(target.what_if), reserved_margin(recipe.planner.reserved_margin)
    )

    def replayed(row: MeshScored) -> MeshScored:
        flat = owners[id(row.scored)].with_reserved(row.scored, model).prediction
        if flat.reserved is None:
            return row
        overhead = (flat.reserved - flat.peak) * activation_share(row.mesh)
        return replace(row, reserved=row.peak + int(overhead), margin=flat.margin)

    out: list[MeshScored] = []
    meshes: set[tuple[int, ...]] = set()
    misfit = False  # the fastest row that does not fit by its peak is replayed too (how short it is)
    for row in sorted(found, key=MeshScored.order):
        if len(meshes) <= RUNNERS_UP and row.peak <= target.budget.usable:
            row = replayed(row)
            if row.required <= target.budget.usable:
                meshes.add((*row.mesh.degrees, row.mesh.ep))
        elif not misfit and row.peak > target.budget.usable:
            row, misfit = replayed(row), True
        out.append(row)
    return out


def _score_data_parallel(
    recipe: Recipe,
    probe: ModelProbe,
    target: Target,
    mesh: MeshShape,
    device: torch.device,
    cost: CostModel | None,
) -> Scoring:
    """Every plan on the mesh's data-parallel dimensions alone (the batch each rank reads, the shard group),
    with no budget: a plan whose undivided states would not fit may fit once tensor and pipeline ranks divide
    them, so every plan is traced (none is cut short at its states)."""
    data_parallel = MeshShape(dp_replicate=mesh.dp_replicate, dp_shard=mesh.dp_shard)
    flat = replace(
        target,
        world_size=data_parallel.size,
        mesh=None if data_parallel.is_flat else data_parallel,
        budget=replace(target.budget, usable=UNBOUNDED),
    )
    return score_candidates(recipe, probe, flat, device, cost=cost)


def _on_mesh(
    scored: Scored,
    mesh: MeshShape,
    evaluation: Evaluation,
    probe: ModelProbe,
    cluster: Cluster,
    tokens_per_step: int,
    moe: MoePlanning | None = None,
) -> MeshScored:
    kept = evaluation.block_activations(scored.plan) if mesh.pp > 1 else (0.0, 0.0)
    cost = mesh_cost(
        scored,
        mesh,
        probe.shape,
        kept,
        cluster=cluster,
        hidden=probe.hidden_size,
        seq_len=probe.seq_len,
        moe=moe,
    )
    return MeshScored(mesh, scored, cost, tokens_per_step / cost.step_seconds / mesh.size)


def _expert_fsdp(scored: Scored) -> bool:
    """Whether a plan can split experts within its shard group: FSDP2 (zero2/zero3), as torchtitan's
    expert-FSDP does; replicated weights and DeepSpeed's flat partitions are not modelled under ep."""
    sharding = scored.plan.sharding
    return sharding.gradient_sync == "reduce-scatter" and sharding.backend == "fsdp2"


def moe_planning(recipe: Recipe, probe: ModelProbe) -> MoePlanning | None:
    """The job's routing with the recipe's bound (`strategies.moe`); None for a dense model."""
    routing = probe.spec.experts
    if routing is None:
        return None
    config = recipe.strategies.moe
    return MoePlanning(routing, config.max_load, config.capacity_factor)


def expert_parallel_degrees(recipe: Recipe, mesh: MeshShape, moe: MoePlanning | None) -> list[int] | str:
    """The ep degrees to score on `mesh`: `auto`, every divisor of the experts count that divides dp_shard
    (1 alone for a dense model); a pinned one if it can split the experts, else why not (naming the key)."""
    chosen = recipe.strategies.mesh.ep
    if chosen == "auto":
        return ep_degrees(moe.routing.experts, mesh.dp_shard) if moe is not None else [1]
    if chosen == 1:
        return [1]
    if moe is None:
        return f"strategies.mesh.ep: {chosen}, but the model has no routed experts; set it to 1"
    if mesh.dp_shard % chosen or moe.routing.experts % chosen:
        return (
            f"strategies.mesh.ep: {chosen} must divide the shard group (dp_shard {mesh.dp_shard}) and the "
            f"{moe.routing.experts} experts"
        )
    return [int(chosen)]


def _shape(degrees: dict[str, int], recipe: Recipe) -> MeshShape:
    config = recipe.strategies.mesh
    return MeshShape(
        **{dim: degrees.get(dim, 1) for dim in DIMS},
        sequence_parallel=config.sequence_parallel,
        pp_schedule=config.pp_schedule,
    )
