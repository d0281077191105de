"""The memory planner: before step 1, predict every allowed plan's peak and pick the fastest that fits.

Entry points:

- `plan_for_run(recipe, env)`: what `memtrain.plan.make_plan` calls when a recipe leaves choices open.
  Every rank measures its headroom (the budget is the minimum over ranks); rank 0 traces and searches
  and broadcasts the result; every rank checks that all ranks hold the same plan (digest), so no rank can
  train with a different plan than its peers.
- `plan_what_if(recipe, world_size, gpu=..., memory_bytes=...)`: the same search for hardware that is not
  here (`memtrain plan --gpu h100-80gb --world-size 64`).
- `calibration(result, measured)`: predicted against measured components, for the run's plan.json.

Layout: hardware.py (budget), model_probe.py + activations.py (shape and traced activations),
states.py + memory_model.py (the predicted peak), candidates.py (the grid), cost.py (step time),
search.py (ranking), explain.py (table and JSON).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from memtrain.distributed import DistEnv, broadcast_object
from memtrain.errors import MemtrainError, PlanError
from memtrain.memory import StepMemory
from memtrain.planner.hardware import GpuProfile, MemoryBudget, Target, measured_target, what_if_target
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.search import PlanResult, Scored, search
from memtrain.recipe import Recipe

__all__ = ["MemoryBudget", "PlanResult", "Scored", "Target", "calibration", "plan_for_run", "plan_what_if"]

Progress = Callable[[str], None]


def stderr_progress(line: str) -> None:
    print(f"[memtrain] planner: {line}", file=sys.stderr, flush=True)


def plan_for_run(recipe: Recipe, env: DistEnv, *, free_bytes: int | None = None,
                 progress: Progress = stderr_progress) -> PlanResult:
    """Plan on this process's device; collective on several ranks (every rank must call it).
    `free_bytes` replaces this rank's measured free memory (tests inject uneven headroom)."""
    target = measured_target(env, int(recipe.memory.budget) if recipe.memory.budget is not None else None,
                             recipe.planner.safety_fraction, free_bytes)
    outcome: PlanResult | str = ""
    failure: MemtrainError | None = None
    if env.is_main:
        try:
            outcome = search(recipe, ModelProbe(recipe, progress=progress), target, env.device, what_if=False)
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


def plan_what_if(recipe: Recipe, world_size: int, *, gpu: GpuProfile | None = None,
                 memory_bytes: int | None = None, progress: Progress = stderr_progress) -> PlanResult:
    """Plan for `world_size` ranks of a GPU that is not here."""
    target = what_if_target(world_size, gpu, memory_bytes, recipe.planner.safety_fraction)
    probe = ModelProbe(recipe, progress=progress)
    return search(recipe, probe, target, torch.device("cuda", 0), what_if=True)


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


def _check_agreement(result: PlanResult, recipe: Recipe, env: DistEnv) -> None:
    if not env.distributed:
        return
    import torch.distributed as dist

    mine = f"{result.plan.digest()}:{recipe.fingerprint()}"
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) != 1:
        raise PlanError(f"ranks disagree on the plan or the recipe (plan digest:recipe fingerprint per rank: "
                        f"{everyone}); launch every rank with the same recipe and overrides")
