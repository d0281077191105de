"""`Plan`: the frozen set of choices a run trains with, and how a recipe's choices become one.

A recipe may leave choices open (`auto`, a list of allowed names, `batch.micro_size: auto`). Then the
memory planner (`memtrain.planner`) predicts the peak memory of every allowed combination, keeps those
that fit the measured headroom and picks the fastest by its step-time model; all ranks agree on it. A
recipe that pins every choice skips the planner: its choices are checked (`Unsupported` with the
strategy's reason when one cannot run here) and used as they are.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError
from memtrain.recipe import Recipe
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.optimizer import OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding import ShardingBackend, make_sharding

if TYPE_CHECKING:
    from memtrain.planner.search import PlanResult


@dataclass(frozen=True)
class Plan:
    precision: str
    checkpointing: str
    checkpointing_fraction: float
    optimizer_states: str
    sharding: str
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    micro_batch_tokens: int | None = None  # set: micro-batches are packed by tokens, not by sequences

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def resolve_plan(recipe: Recipe, env: DistEnv) -> Plan:
    """The plan this run trains with (collective on several ranks when the planner runs)."""
    return make_plan(recipe, env).plan


def make_plan(recipe: Recipe, env: DistEnv, *, free_bytes: int | None = None) -> PlanResult:
    """The plan with what the planner predicted for it (`PlanResult.predicted`, None for a pinned plan).
    `free_bytes` replaces this rank's measured free memory (tests inject uneven headroom)."""
    from memtrain.planner import plan_for_run
    from memtrain.planner.search import PlanResult

    if is_open(recipe):
        return plan_for_run(recipe, env, free_bytes=free_bytes)
    return PlanResult(plan=pinned_plan(recipe, env), backend=recipe.strategies.sharding_backend,
                      offload=recipe.strategies.sharding_offload)


def is_open(recipe: Recipe) -> bool:
    """Whether the recipe leaves anything for the planner to choose."""
    s = recipe.strategies
    choices = (s.precision, s.checkpointing, s.optimizer_states, s.sharding)
    return recipe.batch.micro_size == "auto" and recipe.batch.micro_tokens is None or any(
        not isinstance(c, str) or c == "auto" for c in choices)


def per_rank_batch(recipe: Recipe, world_size: int) -> int:
    """Sequences per rank per step; `RecipeError` when the global batch does not divide."""
    global_size = recipe.batch.global_size
    if global_size % world_size:
        raise RecipeError([f"batch.global_size: {global_size} is not divisible by the world size {world_size}"])
    micro = recipe.batch.micro_size
    if isinstance(micro, int) and (global_size // world_size) % micro:
        raise RecipeError([f"batch.global_size: {global_size} is not divisible by world size x batch.micro_size "
                           f"({world_size} x {micro}); change batch.global_size or batch.micro_size"])
    return global_size // world_size


def pinned_plan(recipe: Recipe, env: DistEnv) -> Plan:
    """The plan of a recipe that pins every choice, each checked on this device."""
    s = recipe.strategies
    assert not is_open(recipe)
    names = {"precision": s.precision, "checkpointing": s.checkpointing,
             "optimizer_states": s.optimizer_states, "sharding": s.sharding}
    precision, checkpointing, optimizer_states, sharding = (str(v) for v in names.values())
    Precision(precision, fp8_emulate=s.fp8_emulate).check(env.device)
    checkpointing_strategy(checkpointing, s.checkpointing_fraction).check(env.device)
    OptimizerStates(optimizer_states).check(env.device)
    make_sharding(sharding, **sharding_options(recipe, precision)).check(env)
    per_rank = per_rank_batch(recipe, env.world_size)
    micro = per_rank if recipe.batch.micro_size == "auto" else recipe.batch.micro_size
    return Plan(
        precision=precision,
        checkpointing=checkpointing,
        checkpointing_fraction=s.checkpointing_fraction if checkpointing == "fraction" else 1.0,
        optimizer_states=optimizer_states,
        sharding=sharding,
        micro_batch_size=micro,
        micro_batch_tokens=recipe.batch.micro_tokens,
        accumulation_steps=per_rank // micro,
        world_size=env.world_size,
    )


def sharding_options(recipe: Recipe, precision: str, micro_batch_size: int = 1,
                     accumulation_steps: int = 1) -> dict[str, Any]:
    """The recipe's sharding options and the plan facts a sharding backend is built with."""
    s = recipe.strategies
    return {
        "backend": s.sharding_backend, "offload": s.sharding_offload, "comm_hook": s.comm_hook,
        "deepspeed_config": s.deepspeed_config, "precision": precision, "grad_clip": recipe.train.grad_clip,
        "micro_batch_size": micro_batch_size, "accumulation_steps": accumulation_steps,
    }


def build_sharding(recipe: Recipe, plan: Plan) -> ShardingBackend:
    """The sharding backend a plan trains with."""
    options = sharding_options(recipe, plan.precision, plan.micro_batch_size, plan.accumulation_steps)
    return make_sharding(plan.sharding, **options)


def checkpointing_strategy(name: str, fraction: float) -> Checkpointing:
    """The recipe's fraction applies only to the `fraction` mode."""
    return Checkpointing(name, fraction if name == "fraction" else 1.0)
