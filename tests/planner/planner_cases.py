"""Shared pieces of the planner tests: a model big enough for the strategies to matter, recipes over it,
and predictions of a given plan as the search makes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.memory.headroom import Target, budget_from
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.search import PlanResult, Scored, search

from helpers import TINY_LLAMA, probe_of, tiny_recipe

MODEL = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 5}
UNBOUNDED = 2**50


def planner_recipe(tmp_path: Path, **sections: dict[str, Any]) -> CausalLMRecipe:
    """A five-block llama, 8 rows of 32 tokens per step, every choice open unless `sections` pin it."""
    base: dict[str, dict[str, Any]] = {
        "model": {"config": MODEL},
        "data": {"seq_len": 32, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}},
        "batch": {"global_size": 8, "micro_size": "auto"},
        "train": {"steps": 2},
        "strategies": {
            "precision": "fp32",
            "checkpointing": "auto",
            "optimizer_states": "auto",
            "sharding": "none",
        },
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_recipe(tmp_path, **base)


def cpu_target(usable: int = UNBOUNDED, world_size: int = 1) -> Target:
    return Target("cpu", world_size, budget_from(usable, usable, 0, 0.0, "test"), bf16=True, fp8=False)


def plan_on(recipe: CausalLMRecipe, target: Target, probe: ModelProbe | None = None) -> PlanResult:
    return search(recipe, probe or probe_of(recipe), target, torch.device("cpu"))


def scored_plan(result: PlanResult, **fields: Any) -> Scored:
    """The one evaluated candidate whose fields match `fields`."""
    (match,) = [
        s
        for s in (*result.ranked, *result.infeasible)
        if all(s.plan.summary()[k] == v for k, v in fields.items())
    ]
    return match
