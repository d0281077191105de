"""`memtrain plan RECIPE [overrides] [--trainer F:C] [--json] [--gpu NAME] [--gpu-memory SIZE] [--world-size N]`.

Why a separate command: planning needs no GPU and no process group, so a person can ask "what would
this recipe run with on 64 H100s, and how close to the edge" on a laptop before asking for the machines.
Without a what-if flag it plans for this machine (its CUDA device, or on CPU the simulated budget
`memory.budget`, else host memory), as `memtrain train` would on one rank. The trainer (built-in, or the
`--trainer` subclass) is constructed and hands the planner its own model, batches and loss.
"""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter, ValidationError

from memtrain import json_out
from memtrain.commands.trainers import trainer_class
from memtrain.errors import PlanError
from memtrain.memory.headroom import load_gpu
from memtrain.planner import PlanResult, plan_here, plan_what_if
from memtrain.planner.explain import describe, to_json
from memtrain.recipe import load_recipe


def run(
    recipe_path: str,
    overrides: list[str],
    *,
    trainer: str | None,
    as_json: bool,
    gpu: str | None,
    gpu_memory: str | None,
    world_size: int | None,
) -> int:
    recipe = load_recipe(recipe_path, overrides)
    ranks = world_size or 1
    spec = trainer_class(trainer)(recipe).model_spec()
    if gpu is not None or gpu_memory is not None:
        memory = _bytes(gpu_memory) if gpu_memory is not None else None
        result = plan_what_if(
            recipe, spec, ranks, gpu=load_gpu(gpu) if gpu is not None else None, memory_bytes=memory
        )
    else:
        result = plan_here(recipe, spec, ranks)
    print(
        json_out.dumps(to_json(result), indent=2)
        if as_json
        else describe(result, _title(recipe_path, result))
    )
    return 0


def _title(recipe_path: str, result: PlanResult) -> str:
    ranks = result.plan.world_size
    return f"memtrain plan: {recipe_path} on {ranks} rank{'s' if ranks != 1 else ''}"


def _bytes(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise PlanError(f"--gpu-memory: {text!r} is not a size; write e.g. 24GiB or 80GB") from None
