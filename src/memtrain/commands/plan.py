"""`memtrain plan RECIPE [overrides] [--trainer F:C] [--json] [--gpu NAME] [--gpu-memory SIZE]
[--host-memory SIZE] [--world-size N]`.

Why a separate command: planning needs no GPU and no process group, so a person can ask "what would
this recipe run with on 64 H100s, and how close to the edge" on a laptop before asking for the machines.
Without a what-if flag it plans for this machine (its CUDA device, or on CPU the simulated budget
`memory.budget`, else host memory), as `memtrain train` would on one rank. The trainer (built-in, or the
`--trainer` subclass) is constructed and hands the planner its own model, batches and loss.
"""

from __future__ import annotations

import re
import sys

from pydantic import ByteSize, TypeAdapter, ValidationError

from memtrain import json_out
from memtrain.commands.trainers import for_recipe, load_checked_recipe, trainer_class
from memtrain.errors import PlanError
from memtrain.memory.headroom import load_gpu
from memtrain.planner import PlanResult, plan_here, plan_what_if
from memtrain.planner.explain import describe, to_json

BARE_NUMBER = re.compile(r"\s*(\d+\.?\d*|\.\d+)\s*")  # --gpu-memory without a unit
GIB = 2**30


def run(
    recipe_path: str,
    overrides: list[str],
    *,
    trainer: str | None,
    as_json: bool,
    gpu: str | None,
    gpu_memory: str | None,
    world_size: int | None,
    host_memory: str | None = None,
) -> int:
    ranks = _ranks(world_size)
    memory = _bytes(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    host = _bytes(host_memory, "--host-memory") if host_memory is not None else None
    if host is not None and gpu is None and memory is None:
        raise PlanError(
            "--host-memory: describes the host of a what-if GPU; add --gpu NAME or --gpu-memory SIZE"
        )
    trainer_cls = trainer_class(trainer)
    recipe = load_checked_recipe(recipe_path, overrides, trainer_cls)
    spec = for_recipe(trainer_cls, recipe)(recipe).model_spec()
    if gpu is not None or memory is not None:
        result = plan_what_if(
            recipe,
            spec,
            ranks,
            gpu=load_gpu(gpu) if gpu is not None else None,
            memory_bytes=memory,
            host_memory_bytes=host,
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


def _ranks(world_size: int | None) -> int:
    if world_size is not None and world_size < 1:
        raise PlanError(f"--world-size: must be at least 1 (it was {world_size})")
    return world_size or 1


def _bytes(text: str, flag: str) -> int:
    """--gpu-memory, --host-memory: a size with a unit as pydantic's ByteSize reads it (24GiB, 24000MiB;
    24GB and 80G are decimal, 10**9 bytes per GB), or a bare number, read as GiB (nobody means 24 bytes),
    which is said on stderr so that JSON on stdout stays clean."""
    if BARE_NUMBER.fullmatch(text):
        size = int(float(text) * GIB)
        print(f"[memtrain] {flag} {text}: no unit given, read as {text.strip()} GiB", file=sys.stderr)
    else:
        try:
            size = int(TypeAdapter(ByteSize).validate_python(text))
        except ValidationError:
            raise PlanError(f"{flag}: {text!r} is not a size; write e.g. 24GiB or 80GB") from None
    if size <= 0:
        raise PlanError(f"{flag}: must be more than 0 (it was {text!r})")
    return size
