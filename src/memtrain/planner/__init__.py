"""The memory planner: before step 1, predict every allowed plan's peak and pick the fastest that fits.

The planner sees the job through a `ModelSpec` (spec.py): the trainer's own `build_model`, blocks,
micro-batches and `loss`. It imports no trainer and no model library.

Entry points:

- `make_plan(recipe, env, spec)`: the plan a run trains with. A recipe that pins every choice gets its
  pinned plan (each strategy checked); otherwise `plan_for_run`.
- `plan_for_run(recipe, env, spec)`: every rank measures its headroom (the budget is the minimum over
  ranks); rank 0 traces and searches and broadcasts the result; every rank checks that all ranks hold
  the same plan (digest), so no rank can train with a different plan than its peers.
- `search_for_run(recipe, env, spec, target, correction=...)`: the collective search itself; a run that
  measured more than predicted re-plans with it (memtrain.training.replan).
- `plan_here(recipe, spec, world_size)` and `plan_what_if(recipe, spec, world_size, gpu=..., memory_bytes=...)`:
  the same search without a process group, for this machine or for hardware that is not here
  (`memtrain plan --gpu h100-80gb --world-size 64`).
- `plan_meshes(recipe, spec, target, cluster, spec_at=...)`: the mesh search (`memtrain plan` when
  `strategies.mesh` leaves a degree other than dp_shard open, or pins a mesh for a what-if:
  `mesh_search.searches_meshes`): every arrangement of the ranks, ranked by predicted tokens/s per GPU on
  the described cluster (mesh_search.py, mesh_cost.py).
- `calibration(result, measured)`: predicted against measured components, for the run's plan.json.

A plan for the device of this process is ranked by step time with this machine's calibrated multipliers
(step_time_calibration.py: fitted to the first steps of earlier runs here and to a timed probe of the
model, step_time_probe.py); a what-if plan with the device class's constants.

Layout: spec.py (the trainer's job), model_probe.py + activations.py (shape and traced activations),
states.py + memory_model.py (the predicted peak), candidates.py (the grid), cost.py +
step_time_calibration.py + step_time_probe.py (step time), search.py (ranking), explain.py (table and
JSON). The budget comes from `memtrain.memory.headroom`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from memtrain.cluster import Cluster
from memtrain.distributed import DistEnv, broadcast_object
from memtrain.errors import MemtrainError, PlanError
from memtrain.memory import StepMemory
from memtrain.memory.headroom import GpuProfile, MemoryBudget, Target, measured_target, what_if_target
from memtrain.mesh import MeshShape
from memtrain.plan import Plan, adapters_of, is_open, mesh_of, pinned_plan, quantization_of
from memtrain.planner.link_calibration import here_cluster, launch_cluster
from memtrain.planner.memory_model import Prediction
from memtrain.planner.mesh_search import MeshResult, open_dims, search_meshes
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.result import PlanResult, Scored
from memtrain.planner.search import search
from memtrain.planner.spec import ModelSpec
from memtrain.planner.step_time_calibration import local_cost_model
from memtrain.recipe import Recipe

__all__ = [
    "MemoryBudget",
    "ModelSpec",
    "PlanResult",
    "Scored",
    "Target",
    "calibration",
    "choose_mesh",
    "here_target",
    "plan_meshes",
    "make_plan",
    "plan_for_run",
    "plan_here",
    "plan_what_if",
    "search_for_run",
]

Progress = Callable[[str], None]


def stderr_progress(line: str) -> None:
    print(f"[memtrain] planner: {line}", file=sys.stderr, flush=True)


def make_plan(
    recipe: Recipe,
    env: DistEnv,
    spec: ModelSpec,
    *,
    free_bytes: int | None = None,
    progress: Progress = stderr_progress,
) -> PlanResult:
    """The plan with what the planner predicted for it (`PlanResult.predicted`, None for a pinned plan);
    collective on several ranks when the planner runs. `free_bytes` replaces this rank's measured free
    memory (tests inject uneven headroom)."""
    if is_open(recipe):
        return plan_for_run(recipe, env, spec, free_bytes=free_bytes, progress=progress)
    plan = pinned_plan(recipe, env)
    if recipe.memory.budget is None:  # a simulated budget is judged by training.preflight, also in validate
        _check_pinned_weights(recipe, env, spec, plan, free_bytes)
    return PlanResult(plan=plan)


def _check_pinned_weights(
    recipe: Recipe, env: DistEnv, spec: ModelSpec, plan: Plan, free_bytes: int | None
) -> None:
    """`PlanError` when the pinned plan's weights alone (counted from the model's meta-device shapes) are
    more than this device can hold. Why: a pinned plan is not predicted, so a config claiming 70B made
    `setup()` allocate gigabytes of weights before anything said it could not fit."""
    if plan.quantization.name != "none":  # its bytes depend on which linears are quantised
        return
    with torch.device("meta"):
        numel = sum(p.numel() for p in spec.build_model().parameters())
    element = torch.empty((), dtype=plan.precision.stored_dtype).element_size()
    weights = numel * element // (1 if plan.sharding.replicated else plan.world_size)
    usable = measured_target(env, None, recipe.planner.safety_fraction, free_bytes).budget.usable
    if weights > usable:
        raise PlanError(
            f"the model's {numel:,} parameters are {weights / 2**30:.1f} GiB of {plan.precision.name} weights "
            f"alone on each rank, more than the {usable / 2**30:.1f} GiB usable on this {env.device.type}; "
            "train a smaller model, or leave strategies to the planner (auto) and add ranks"
        )


def plan_for_run(
    recipe: Recipe,
    env: DistEnv,
    spec: ModelSpec,
    *,
    free_bytes: int | None = None,
    progress: Progress = stderr_progress,
) -> PlanResult:
    """Plan on this process's device; collective on several ranks (every rank must call it).
    `free_bytes` replaces this rank's measured free memory (tests inject uneven headroom)."""
    target = measured_target(
        env,
        int(recipe.memory.budget) if recipe.memory.budget is not None else None,
        recipe.planner.safety_fraction,
        free_bytes,
    )
    return search_for_run(recipe, env, spec, target, progress=progress)


def search_for_run(
    recipe: Recipe,
    env: DistEnv,
    spec: ModelSpec,
    target: Target,
    *,
    correction: Callable[[Prediction], Prediction] | None = None,
    progress: Progress = stderr_progress,
) -> PlanResult:
    """Rank 0 searches `target` (each prediction through `correction`, when given) and broadcasts the
    result; every rank checks it holds the same plan. Collective on several ranks. A run re-plans
    through this too (memtrain.training.replan), with the budget it started with."""
    outcome: PlanResult | str = ""
    failure: MemtrainError | None = None
    if env.is_main:
        try:
            probe = _probe(recipe, spec, progress)
            outcome = search(
                recipe,
                probe,
                target,
                env.device,
                cost=None if target.what_if else local_cost_model(env.device, probe, target.budget.usable),
                correction=correction,
            )
        except MemtrainError as exc:
            if not env.distributed:
                raise
            failure, outcome = exc, f"{type(exc).__name__}: {exc}"  # every rank raises, none waits for a plan
    outcome = broadcast_object(outcome, env)  # type: ignore[assignment]
    if failure is not None:
        raise failure
    if isinstance(outcome, str):
        raise PlanError(f"rank 0 could not plan: {outcome}")
    _check_agreement(outcome, recipe, env)
    return outcome


def plan_here(
    recipe: Recipe, spec: ModelSpec, world_size: int = 1, *, progress: Progress = stderr_progress
) -> PlanResult:
    """Plan for `world_size` ranks like this process's device, without a process group (`memtrain plan`):
    its CUDA device, or on CPU the simulated budget `memory.budget`, else host memory."""
    target = here_target(recipe, world_size)
    device = torch.device("cuda", 0) if target.device_type == "cuda" else torch.device("cpu")
    probe = _probe(recipe, spec, progress)
    return search(recipe, probe, target, device, cost=local_cost_model(device, probe, target.budget.usable))


def here_target(recipe: Recipe, world_size: int) -> Target:
    """`world_size` ranks like this process's device: its CUDA device, or on CPU the simulated budget
    `memory.budget`, else host memory."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    here = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
    budget = int(recipe.memory.budget) if recipe.memory.budget is not None else None
    return replace(
        measured_target(here, budget, recipe.planner.safety_fraction),
        world_size=world_size,
        mesh=mesh_of(recipe, world_size),
    )


def plan_what_if(
    recipe: Recipe,
    spec: ModelSpec,
    world_size: int,
    *,
    gpu: GpuProfile | None = None,
    memory_bytes: int | None = None,
    host_memory_bytes: int | None = None,
    progress: Progress = stderr_progress,
) -> PlanResult:
    """Plan for `world_size` ranks of a GPU that is not here (`host_memory_bytes`: host memory per GPU
    for offloaded states, instead of the profile's)."""
    target = what_if_target(
        world_size, gpu, memory_bytes, recipe.planner.safety_fraction, host_memory_bytes=host_memory_bytes
    )
    target = replace(target, mesh=mesh_of(recipe, world_size))
    return search(
        recipe,
        _probe(recipe, spec, progress),
        target,
        torch.device("cuda", 0),
    )


def plan_meshes(
    recipe: Recipe,
    spec: ModelSpec,
    target: Target,
    cluster: Cluster,
    *,
    spec_at: Callable[[int], ModelSpec],
    progress: Progress = stderr_progress,
) -> MeshResult:
    """The mesh search (planner/mesh_search.py) for `target`'s ranks on `cluster`; `spec_at(seq_len)`: the
    trainer's job at another sequence length (what one context-parallel rank runs; probed once per length).
    For a target that is here, the links a run on this machine measured replace `cluster`'s
    (link_calibration.py)."""
    probes: dict[int, ModelProbe] = {}
    device = torch.device("cuda", 0) if target.device_type == "cuda" else torch.device("cpu")
    if not target.what_if:
        cluster, measured = here_cluster(cluster, target.world_size, device)
        if measured is not None:
            progress(measured)

    def probe_for(cp: int) -> ModelProbe:
        if cp not in probes:
            probes[cp] = _probe(recipe, spec if cp == 1 else spec_at(probes[1].seq_len // cp), progress)
        return probes[cp]

    probe_for(1)
    return search_meshes(
        recipe,
        probe_for,
        target,
        cluster,
        device,
        tensor_parallel_problems=spec.tensor_parallel_problems,
        pipeline=spec.pipeline,
        cost=None if target.what_if else local_cost_model(device, probe_for(1), target.budget.usable),
    )


def choose_mesh(
    recipe: Recipe, env: DistEnv, spec: ModelSpec, *, progress: Progress = stderr_progress
) -> MeshShape | None:
    """The mesh a run trains on when its recipe leaves degrees beyond dp_shard open (None otherwise): the mesh
    search on the measured budget (the minimum over ranks) and this launch's node (torchrun's
    LOCAL_WORLD_SIZE GPUs per node), run by rank 0 and broadcast. Collective on several ranks. The plan on
    that mesh is then made as for a pinned one (`make_plan`)."""
    if not set(open_dims(recipe)) - {"dp_shard"}:
        return None
    budget = int(recipe.memory.budget) if recipe.memory.budget is not None else None
    target = measured_target(env, budget, recipe.planner.safety_fraction)
    outcome: dict[str, Any] | str = ""
    if env.is_main:
        cluster = launch_cluster(env.world_size)
        try:
            found = plan_meshes(recipe, spec, target, cluster, spec_at=lambda _seq: spec, progress=progress)
            best = found.chosen or found.best_misfit
            outcome = best.mesh.to_dict() if best is not None else "no mesh could be scored"
        except MemtrainError as exc:
            if not env.distributed:
                raise
            outcome = f"{type(exc).__name__}: {exc}"
    outcome = broadcast_object(outcome, env)  # type: ignore[assignment]
    if isinstance(outcome, str):
        raise PlanError(f"rank 0 could not choose a mesh: {outcome}")
    return MeshShape.from_dict(outcome)


def calibration(result: PlanResult, measured: StepMemory) -> dict[str, Any]:
    """Predicted against measured for plan.json: the peak and each component (bytes, and the relative
    error of the prediction, positive when it over-predicted)."""
    if result.predicted is None:
        return {"predicted": None, "measured": {"peak": measured.peak_bytes, **measured.at_peak}}
    predicted = result.predicted.to_dict()
    observed = {**measured.at_peak, "peak": measured.peak_bytes}
    return {
        "predicted": predicted,
        "measured": observed,
        "relative_error": {k: (predicted[k] - v) / v for k, v in observed.items() if v},
        "predicted_where": result.chosen.prediction.where if result.chosen is not None else None,
        "measured_where": f"{measured.peak_phase} {measured.peak_module}".strip(),
    }


def _probe(recipe: Recipe, spec: ModelSpec, progress: Progress) -> ModelProbe:
    """The trainer's model as the planner sees it, with the recipe's adapters and base quantisation."""
    return ModelProbe(
        spec, progress=progress, adapters=adapters_of(recipe), quantization=quantization_of(recipe)
    )


def _check_agreement(result: PlanResult, recipe: Recipe, env: DistEnv) -> None:
    if not env.distributed:
        return
    import torch.distributed as dist

    mine = f"{result.plan.digest()}:{recipe.fingerprint()}"
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) != 1:
        raise PlanError(
            f"ranks disagree on the plan or the recipe (plan digest:recipe fingerprint per rank: "
            f"{everyone}); launch every rank with the same recipe and overrides"
        )
