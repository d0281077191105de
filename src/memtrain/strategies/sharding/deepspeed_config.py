"""The DeepSpeed config: generated from the plan, merged with the user's JSON, contradictions reported.

Why generate it: a DeepSpeed JSON copied from a blog silently disagrees with the run (another
micro-batch, another clipping, another precision), and DeepSpeed resolves some of these
disagreements by itself. Here the plan owns every key that changes the meaning or the memory class of
the run ("owned" keys: batch sizes, accumulation, clipping, ZeRO stage, offload devices, bf16/fp16),
and the user's JSON (`strategies.deepspeed_config`) may add or tune anything else (bucket sizes,
overlap, persistence threshold...). A user key that contradicts an owned key is an error that lists
every such key; it is never resolved silently. `"auto"` (the Hugging Face convention) is accepted for
owned keys. `optimizer` and `scheduler` sections contradict the recipe (memtrain builds the optimizer
from `train:` and sets the learning rate every step).

Accumulation is owned by the trainer: it runs the micro-steps, normalises by the global token count
and tells DeepSpeed which micro-step is the boundary. DeepSpeed is given the same numbers
(`gradient_accumulation_steps`, `train_batch_size`) only so that its bookkeeping agrees.

Generated defaults that are not owned: bucket sizes are DeepSpeed's defaults capped at the model's
size (the ZeRO-2 reduce bucket is allocated whole in every backward: 5e8 elements are 2 GB in fp32
whatever the model), progress printing off, and `zero_force_ds_cpu_optimizer=false` so that offload
keeps the recipe's torch optimizer (DeepSpeedCPUAdam would change the numerics).

The user's JSON is checked when it is read (`read_user_config`, before the model is built): sections
that must be objects are objects, the keys memtrain sets or owns have JSON values of their type, and
the forbidden sections are absent. `training.deepspeed_checks` adds the contradictions the recipe alone decides
(ZeRO stage, precision, clipping, offload, batch sizes when pinned), so `memtrain validate` reports
them without a plan.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from memtrain.errors import RecipeError, shortened
from memtrain.jsonfile import read_json_object

DEEPSPEED_BUCKET_DEFAULT = 500_000_000  # reduce/allgather bucket elements (DeepSpeed's default)
DEEPSPEED_PREFETCH_DEFAULT = 50_000_000  # stage3_prefetch_bucket_size
USER_KEY = "strategies.deepspeed_config"
FORBIDDEN_SECTIONS = {
    "optimizer": "memtrain builds the optimizer from optimizer.name and train: (and strategies.optimizer_states)",
    "scheduler": "memtrain sets the learning rate every step from train: (schedule, lr, warmup_steps, min_lr_ratio)",
}
SECTIONS = (
    "zero_optimization",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "bf16",
    "fp16",
)
"""Dotted keys that must hold JSON objects when present (memtrain sets keys inside them)."""
KEY_TYPES: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "integer",
    "gradient_accumulation_steps": "integer",
    "train_batch_size": "integer",
    "gradient_clipping": "number",
    "zero_optimization.stage": "integer",
    "zero_optimization.offload_optimizer.device": "string",
    "zero_optimization.offload_param.device": "string",
    "bf16.enabled": "boolean",
    "fp16.enabled": "boolean",
    "steps_per_print": "integer",
    "zero_force_ds_cpu_optimizer": "boolean",
    "zero_optimization.reduce_bucket_size": "number",
    "zero_optimization.allgather_bucket_size": "number",
    "zero_optimization.stage3_prefetch_bucket_size": "number",
}
"""The JSON type of each key memtrain owns or generates (owned keys also take "auto")."""


@dataclass(frozen=True)
class DeepSpeedPlan:
    stage: int
    precision: str  # fp32 or bf16-mixed
    offload: str  # none, optimizer, params
    micro_batch_size: int
    accumulation_steps: int
    world_size: int
    grad_clip: float | None
    model_numel: int


def owned_keys(plan: DeepSpeedPlan) -> dict[str, Any]:
    """Dotted keys the plan decides, with their values."""
    offload_optimizer = "cpu" if plan.offload in ("optimizer", "params") else "none"
    keys: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.accumulation_steps,
        "train_batch_size": plan.micro_batch_size * plan.accumulation_steps * plan.world_size,
        "gradient_clipping": float(plan.grad_clip) if plan.grad_clip is not None else 0.0,
        "zero_optimization.stage": plan.stage,
        "zero_optimization.offload_optimizer.device": offload_optimizer,
        "bf16.enabled": plan.precision == "bf16-mixed",
        "fp16.enabled": False,
    }
    if plan.stage == 3:
        keys["zero_optimization.offload_param.device"] = "cpu" if plan.offload == "params" else "none"
    return keys


def default_keys(plan: DeepSpeedPlan) -> dict[str, Any]:
    """Generated values the user's JSON may override."""
    cap = plan.model_numel + plan.model_numel % 2  # DeepSpeed wants even bucket sizes
    keys: dict[str, Any] = {
        "steps_per_print": 2**31 - 1,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization.reduce_bucket_size": min(DEEPSPEED_BUCKET_DEFAULT, cap),
    }
    if plan.stage == 3:
        keys["zero_optimization.stage3_prefetch_bucket_size"] = min(DEEPSPEED_PREFETCH_DEFAULT, cap)
    else:
        keys["zero_optimization.allgather_bucket_size"] = min(DEEPSPEED_BUCKET_DEFAULT, cap)
    return keys


def read_user_config(path: str) -> dict[str, Any]:
    """The user's JSON; `RecipeError` listing every section of the wrong shape, key of the wrong type and
    forbidden section."""
    user = read_json_object(path, USER_KEY)
    problems = shape_problems(user)
    if problems:
        raise RecipeError(problems)
    return user


def shape_problems(user: dict[str, Any]) -> list[str]:
    """Forbidden sections, sections that are not objects, and owned or generated keys of the wrong type."""
    problems = [
        f"{USER_KEY}: remove the {section!r} section ({why})"
        for section, why in FORBIDDEN_SECTIONS.items()
        if section in user
    ]
    for section in SECTIONS:
        found, value = _get(user, section)
        if found and not isinstance(value, dict):
            problems.append(f"{USER_KEY}: {section} must be a JSON object (got {shortened(value)})")
    for key, kind in KEY_TYPES.items():
        found, value = _get(user, key)
        auto = value == "auto" and key not in ("steps_per_print", "zero_force_ds_cpu_optimizer")
        if found and not auto and not _is(value, kind):
            problems.append(f"{USER_KEY}: {key} must be a JSON {kind} (got {shortened(value)})")
    return problems


def contradictions(user: dict[str, Any], owned: dict[str, Any]) -> list[str]:
    """A line for every key of `owned` that the user's JSON sets to another value of its type ("auto"
    agrees; a value of the wrong type is `shape_problems`' to report)."""
    problems = []
    for key, value in owned.items():
        found, given = _get(user, key)
        if found and given != "auto" and _is(given, KEY_TYPES[key]) and not _same(given, value):
            problems.append(
                f"{USER_KEY}: {key}={shortened(given)} contradicts the recipe's plan ({key}={value!r}); remove it "
                "from the JSON or change the recipe"
            )
    return problems


def build_config(plan: DeepSpeedPlan, user: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config DeepSpeed runs with; `RecipeError` lists every user key that contradicts the plan."""
    user = user or {}
    problems = shape_problems(user) + contradictions(user, owned_keys(plan))
    if problems:
        raise RecipeError(problems)
    config: dict[str, Any] = {}
    for key, value in default_keys(plan).items():
        _set(config, key, value)
    config = _merge(config, user)
    for key, value in owned_keys(plan).items():
        _set(config, key, value)
    return config


def _is(value: Any, kind: str) -> bool:
    if kind == "boolean" or isinstance(value, bool):
        return kind == "boolean" and isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int)
    if kind == "number":
        return isinstance(value, (int, float))
    return isinstance(value, str)


def names(choice: str | list[str]) -> list[str]:
    return [choice] if isinstance(choice, str) else choice


def _same(given: Any, wanted: Any) -> bool:
    if isinstance(wanted, bool) or isinstance(given, bool):
        return given is wanted
    if isinstance(wanted, (int, float)) and isinstance(given, (int, float)):
        return float(given) == float(wanted)
    return bool(given == wanted)


def _get(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
