"""`memtrain plan RECIPE [overrides] [--json] [--gpu NAME] [--gpu-memory SIZE] [--world-size N]`.

Why a separate command: planning needs no GPU and no process group, so a person can ask "what would
this recipe run with on 64 H100s, and how close to the edge" on a laptop before asking for the machines.
Without a what-if flag it plans for this machine (its CUDA device, or on CPU the simulated budget
`memory.budget`, else host memory), as `memtrain train` would on one rank.
"""

from __future__ import annotations

import json
from dataclasses import replace

import torch
from pydantic import ByteSize, TypeAdapter, ValidationError

from memtrain.distributed import DistEnv
from memtrain.errors import PlanError
from memtrain.planner import plan_what_if, stderr_progress
from memtrain.planner.explain import describe, to_json
from memtrain.planner.hardware import load_gpu, measured_target
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.search import PlanResult, search
from memtrain.recipe import load_recipe


def run(recipe_path: str, overrides: list[str], *, as_json: bool, gpu: str | None, gpu_memory: str | None,
        world_size: int | None) -> int:
    recipe = load_recipe(recipe_path, overrides)
    ranks = world_size or 1
    if gpu is not None or gpu_memory is not None:
        memory = _bytes(gpu_memory) if gpu_memory is not None else None
        result = plan_what_if(recipe, ranks, gpu=load_gpu(gpu) if gpu is not None else None, memory_bytes=memory)
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        here = DistEnv(rank=0, world_size=1, local_rank=0, device=device)
        budget = int(recipe.memory.budget) if recipe.memory.budget is not None else None
        target = replace(measured_target(here, budget, recipe.planner.safety_fraction), world_size=ranks)
        result = search(recipe, ModelProbe(recipe, progress=stderr_progress), target, device, what_if=False)
    print(json.dumps(to_json(result), indent=2) if as_json else describe(result, _title(recipe_path, result)))
    return 0


def _title(recipe_path: str, result: PlanResult) -> str:
    ranks = result.plan.world_size
    return f"memtrain plan: {recipe_path} on {ranks} rank{'s' if ranks != 1 else ''}"


def _bytes(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise PlanError(f"--gpu-memory: {text!r} is not a size; write e.g. 24GiB or 80GB") from None
