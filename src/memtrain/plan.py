"""`Plan`: the frozen set of choices a run trains with, and how a recipe's choices become one.

The recipe may leave choices open (`auto`, or a list of allowed names). Until the memory planner
(issue 6) predicts and compares candidates, open choices resolve by fixed, documented rules:
`auto` precision → bf16-mixed where the GPU supports it, else fp32; `auto` checkpointing → none; `auto` optimizer states → fp32;
`auto` sharding → ddp on several
ranks, else none; a list → its first entry that passes its strategy's check; `auto` micro-batch → the
whole per-rank step batch (no accumulation). Pinned choices are always honoured or rejected with the
reason.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError, Unsupported
from memtrain.recipe import Recipe
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.optimizer import OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding import ShardingBackend, make_sharding


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
    """Turn the recipe's (possibly open) choices into a concrete plan for this world size."""
    precision = _choose(
        "strategies.precision",
        recipe.strategies.precision,
        auto=["bf16-mixed", "fp32"] if env.device.type == "cuda" else ["fp32"],
        check=lambda name: Precision(name, fp8_emulate=recipe.strategies.fp8_emulate).check(env.device),
    )
    fraction = recipe.strategies.checkpointing_fraction
    checkpointing = _choose(
        "strategies.checkpointing",
        recipe.strategies.checkpointing,
        auto=["none"],
        check=lambda name: checkpointing_strategy(name, fraction).check(env.device),
    )
    optimizer_states = _choose(
        "strategies.optimizer_states",
        recipe.strategies.optimizer_states,
        auto=["fp32"],
        check=lambda name: OptimizerStates(name).check(env.device),
    )
    sharding = _choose(
        "strategies.sharding",
        recipe.strategies.sharding,
        auto=["ddp"] if env.distributed else ["none"],
        check=lambda name: make_sharding(name, **sharding_options(recipe, precision)).check(env),
    )
    global_size = recipe.batch.global_size
    if global_size % env.world_size:
        raise RecipeError(
            [f"batch.global_size: {global_size} is not divisible by the world size {env.world_size}"]
        )
    per_rank = global_size // env.world_size
    micro = per_rank if recipe.batch.micro_size == "auto" else recipe.batch.micro_size
    if per_rank % micro:
        raise RecipeError(
            [
                f"batch.global_size: {global_size} is not divisible by world size x batch.micro_size "
                f"({env.world_size} x {micro}); change batch.global_size or batch.micro_size"
            ]
        )
    return Plan(
        precision=precision,
        checkpointing=checkpointing,
        checkpointing_fraction=fraction if checkpointing == "fraction" else 1.0,
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


def _choose(key: str, value: str | list[str], auto: list[str], check: object) -> str:
    candidates = auto if value == "auto" else [value] if isinstance(value, str) else list(value)
    reasons = []
    for name in candidates:
        try:
            check(name)  # type: ignore[operator]
            return name
        except Unsupported as exc:
            if isinstance(value, str) and value != "auto":
                raise
            reasons.append(str(exc))
    raise Unsupported(f"{key}: none of {candidates} can run here: " + "; ".join(reasons))
