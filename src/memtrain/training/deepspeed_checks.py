"""The DeepSpeed checks that need the recipe: what a user's `strategies.deepspeed_config` JSON
contradicts in the recipe, found without a plan, so `memtrain validate` reports it.

Why here and not in `strategies.sharding.deepspeed_config`: the strategies never reach the recipe (the
architecture test holds that arrow); that module knows the JSON's shape and the keys memtrain owns, this
one reads the recipe's values for those keys.
"""

from __future__ import annotations

from typing import Any

from memtrain.errors import RecipeError
from memtrain.jsonfile import read_json_object
from memtrain.recipe import Recipe
from memtrain.strategies.sharding import deepspeed_config


def recipe_problems(recipe: Recipe) -> list[str]:
    """The problems of `strategies.deepspeed_config` that the recipe alone decides (without a plan): its
    shape, and the owned keys the recipe pins that the JSON contradicts. Empty unless the recipe may run
    on DeepSpeed with a JSON of its own."""
    s = recipe.strategies
    may_shard = any(n == "auto" or n.startswith("zero") for n in deepspeed_config.names(s.sharding))
    if s.deepspeed_config is None or s.sharding_backend != "deepspeed" or not may_shard:
        return []
    try:
        user = read_json_object(s.deepspeed_config, deepspeed_config.USER_KEY)
    except RecipeError as exc:
        return exc.problems
    return deepspeed_config.shape_problems(user) + deepspeed_config.contradictions(user, recipe_keys(recipe))


def recipe_keys(recipe: Recipe) -> dict[str, Any]:
    """The owned keys (`deepspeed_config.owned_keys`) whose value the recipe decides whatever the plan."""
    s, batch = recipe.strategies, recipe.batch
    grad_clip = recipe.train.grad_clip
    keys: dict[str, Any] = {
        "gradient_clipping": float(grad_clip) if grad_clip is not None else 0.0,
        "fp16.enabled": False,
    }
    offload = (
        s.sharding_offload if isinstance(s.sharding_offload, str) and s.sharding_offload != "auto" else None
    )
    if offload is not None:  # an open offload is the planner's choice: nothing to compare yet
        keys["zero_optimization.offload_optimizer.device"] = "cpu" if offload != "none" else "none"
    if batch.micro_tokens is None:
        keys["train_batch_size"] = batch.global_size
    if isinstance(batch.micro_size, int):
        keys["train_micro_batch_size_per_gpu"] = batch.micro_size
    if isinstance(s.precision, str) and s.precision != "auto":
        keys["bf16.enabled"] = s.precision == "bf16-mixed"
    stages = {int(n[-1]) for n in deepspeed_config.names(s.sharding) if n.startswith("zero")}
    if len(stages) == 1 and s.sharding != "auto":
        keys["zero_optimization.stage"] = stage = stages.pop()
        if stage == 3 and offload is not None:
            keys["zero_optimization.offload_param.device"] = "cpu" if offload == "params" else "none"
    return keys
