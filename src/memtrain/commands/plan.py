"""`memtrain plan RECIPE [overrides] [--trainer F:C] [--json] [--gpu NAME] [--gpu-memory SIZE]
[--host-memory SIZE] [--world-size N] [--nodes N] [--gpus-per-node G]`.

Why a separate command: planning needs no GPU and no process group, so a person can ask "what would
this recipe run with on 64 H100s, and how close to the edge" on a laptop before asking for the machines.
Without a what-if flag it plans for this machine (its CUDA device, or on CPU the simulated budget
`memory.budget`, else host memory), as `memtrain train` would on one rank. The trainer (built-in, or the
`--trainer` subclass) is constructed and hands the planner its own model, batches and loss.

When the recipe's `strategies.mesh` leaves a degree other than dp_shard open (`auto`) or pins one above 1,
the plan is a mesh search (planner/mesh_search.py): every arrangement of the ranks on the cluster the
`--gpu` profile describes (`--nodes`, `--gpus-per-node` override its node), ranked by tokens/s per GPU.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace

from pydantic import ByteSize, TypeAdapter, ValidationError

from memtrain import json_out
from memtrain.cluster import DEFAULT_CLUSTER, Cluster
from memtrain.commands.trainers import for_recipe, load_checked_recipe, trainer_class
from memtrain.errors import PlanError, RecipeError
from memtrain.memory.headroom import GpuProfile, load_gpu, what_if_target
from memtrain.planner import ModelSpec, PlanResult, here_target, plan_here, plan_meshes, plan_what_if
from memtrain.planner.explain import describe, to_json
from memtrain.planner.mesh_explain import describe_meshes, meshes_to_json
from memtrain.planner.mesh_search import searches_meshes
from memtrain.recipe import MeshConfig, Recipe
from memtrain.training.trainer import Trainer

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
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    name: str | None = None,
) -> int:
    """Plan the recipe at `recipe_path` (`name`: how the title calls it, default its path)."""
    profile = load_gpu(gpu) if gpu is not None else None
    cluster = _cluster(profile, gpus_per_node)
    ranks = _ranks(world_size, nodes, cluster)
    memory = _bytes(gpu_memory, "--gpu-memory") if gpu_memory is not None else None
    host = _bytes(host_memory, "--host-memory") if host_memory is not None else None
    if host is not None and gpu is None and memory is None:
        raise PlanError(
            "--host-memory: describes the host of a what-if GPU; add --gpu NAME or --gpu-memory SIZE"
        )
    trainer_cls = trainer_class(trainer)
    recipe = load_checked_recipe(recipe_path, overrides, trainer_cls)
    what_if = gpu is not None or memory is not None
    if searches_meshes(recipe, what_if):
        target = (
            what_if_target(ranks, profile, memory, recipe.planner.safety_fraction, host_memory_bytes=host)
            if what_if
            else here_target(recipe, ranks)
        )
        found = plan_meshes(
            recipe,
            _spec(trainer_cls, recipe),
            replace(target, mesh=None),
            cluster,
            spec_at=lambda seq: _spec(trainer_cls, _at_sequence(recipe_path, overrides, trainer_cls, seq)),
        )
        title = (
            f"memtrain plan: {name or recipe_path} on {ranks} rank{'s' if ranks != 1 else ''} (mesh search)"
        )
        if found.chosen is None:  # as the one-device plan: the table is the error
            raise PlanError(f"no plan fits on any mesh of {ranks} ranks\n{describe_meshes(found, title)}")
        print(json_out.dumps(meshes_to_json(found), indent=2) if as_json else describe_meshes(found, title))
        return 0
    spec = for_recipe(trainer_cls, recipe)(recipe).model_spec()
    if gpu is not None or memory is not None:
        result = plan_what_if(
            recipe,
            spec,
            ranks,
            gpu=profile,
            memory_bytes=memory,
            host_memory_bytes=host,
        )
    else:
        result = plan_here(recipe, spec, ranks)
    print(
        json_out.dumps(to_json(result), indent=2)
        if as_json
        else describe(result, _title(name or recipe_path, result))
    )
    return 0


def _title(recipe_path: str, result: PlanResult) -> str:
    ranks = result.plan.world_size
    return f"memtrain plan: {recipe_path} on {ranks} rank{'s' if ranks != 1 else ''}"


def _ranks(world_size: int | None, nodes: int | None, cluster: Cluster) -> int:
    if world_size is not None and world_size < 1:
        raise PlanError(f"--world-size: must be at least 1 (it was {world_size})")
    if nodes is None:
        return world_size or 1
    if nodes < 1:
        raise PlanError(f"--nodes: must be at least 1 (it was {nodes})")
    ranks = nodes * cluster.gpus_per_node
    if world_size is not None and world_size != ranks:
        raise PlanError(
            f"--world-size {world_size} disagrees with --nodes {nodes} x {cluster.gpus_per_node} GPUs per node "
            f"= {ranks}; give one of them, or set --gpus-per-node"
        )
    return ranks


def _cluster(profile: GpuProfile | None, gpus_per_node: int | None) -> Cluster:
    """The profile's node (or the default one), with `--gpus-per-node` when given."""
    cluster = profile.cluster if profile is not None else DEFAULT_CLUSTER
    if gpus_per_node is None:
        return cluster
    if gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node: must be at least 1 (it was {gpus_per_node})")
    return replace(cluster, gpus_per_node=gpus_per_node)


def _spec(trainer_cls: type[Trainer], recipe: Recipe) -> ModelSpec:
    """The trainer's job, built on one process: the mesh is the search's, so the trainer sees none."""
    flat = recipe.model_copy(
        update={"strategies": recipe.strategies.model_copy(update={"mesh": MeshConfig()})}
    )
    return for_recipe(trainer_cls, flat)(flat).model_spec()


def _at_sequence(recipe_path: str, overrides: list[str], trainer_cls: type[Trainer], seq_len: int) -> Recipe:
    """The recipe at another `data.seq_len` (what one context-parallel rank reads)."""
    try:
        return load_checked_recipe(recipe_path, [*overrides, f"data.seq_len={seq_len}"], trainer_cls)
    except RecipeError as exc:
        raise PlanError(
            f"strategies.mesh.cp: context parallelism is planned at data.seq_len / cp, which this recipe cannot "
            f"take ({'; '.join(exc.problems)}); set strategies.mesh.cp: 1"
        ) from None


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
