"""The planner's rules without its memory: would `train` stop before the first step because the recipe's
own choices leave no plan that can run, whatever the memory?

Why: the grid (`candidates.build_grid`) drops every combination a rule forbids (a quantised base with a
sharding that cannot hold it, a loss DeepSpeed ZeRO-3 cannot run, `in_backward` with accumulation or a
master copy, a sharding that cannot train on this many ranks, offload where it saves nothing, ...). When
the rules drop them all, `train` and `plan` used to answer "no plan fits the memory budget", and `memtrain
validate` said ok, as it never built the grid. Here the same grid (or the pinned plan, for a recipe that
pins every choice) is built for the device and ranks `train` would use, without a model or a trace, so
`validate` reports each rule that leaves nothing, naming its keys; `explain` leads "no plan fits" with the
same lines when the rules, not memory, are the cause. Which rules exclude a combination is independent
of the model's depth (depth only merges checkpointing variants that run alike), so no model is built.
"""

from __future__ import annotations

import os

import torch

from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError, Unsupported
from memtrain.plan import is_open, mesh_of, pinned_plan
from memtrain.planner.candidates import build_grid
from memtrain.recipe import Recipe
from memtrain.strategies.registry import DeviceFacts

DEPTH = 2  # any depth gives the same verdict (module docstring); two blocks: the cheapest to describe


def ruled_out(excluded: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> list[str]:
    """One line per rule that left the grid empty: `<recipe key=value>: <why>` (the keys to change)."""
    return [f"{what}: {why}" for what, why in excluded]


def rule_problems(recipe: Recipe, facts: DeviceFacts | None = None) -> list[str]:
    """Why no plan can run for `recipe`, memory aside: a pinned strategy that cannot run, or every
    candidate excluded (a lead line, then each exclusion). Empty when some plan can run. `facts`: the
    device `train` would use here (its CUDA device, else the CPU, `WORLD_SIZE` ranks) unless given (a
    what-if GPU; then a pinned recipe is judged as the planner's grid judges it). Batch problems (a
    global batch the ranks do not divide) are `preflight`'s own lines, not repeated here."""
    here = this_device() if facts is None else None
    try:
        if here is not None:
            here = here.with_mesh(mesh_of(recipe, here.world_size))
            facts = DeviceFacts.of(here.device, here.world_size, here.mesh)
        assert facts is not None
        device = here.device if here is not None else torch.device(facts.device_type)
        if here is not None and not is_open(recipe):
            pinned_plan(recipe, here)
            return []
        grid = build_grid(recipe, facts, device, DEPTH)
    except Unsupported as exc:
        return [str(exc)]
    except RecipeError:
        return []
    if grid.candidates:
        return []
    ranks = f"{facts.world_size} rank{'s' if facts.world_size != 1 else ''}"
    return [
        f"strategies: no plan can run on {ranks} of {facts.device_type}: the recipe's choices exclude every "
        "candidate (not memory: `train` would stop with 'no plan fits'); change one of the keys below",
        *ruled_out(grid.excluded),
    ]


def this_device() -> DistEnv:
    """The device and ranks `train` would start with here (its CUDA device, else the CPU; `WORLD_SIZE`)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    return DistEnv(rank=0, world_size=world_size, local_rank=0, device=device)
