"""memtrain: LLM training that knows, before step 1, what fits in GPU memory and what is fastest.

Public names: `Trainer` (subclass it), `CausalLMTrainer` (any transformers causal-LM config),
`Recipe` (typed YAML recipes: `Recipe.load(path)`; `RecipeSection` for a trainer's own sections), `Plan`
(the strategies a run trains with) and `make_plan` (the planner's choice for a trainer's `model_spec()` when the recipe leaves choices open).

Each name is imported on first use (PEP 562): `import memtrain` itself loads neither torch nor
transformers, so the command line starts its own imports inside its Ctrl-C handling (torch alone takes
seconds) and `CausalLMTrainer` costs its second only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memtrain.causal_lm.trainer import CausalLMTrainer
    from memtrain.errors import MemtrainError, PlanError, RecipeError, Unsupported
    from memtrain.plan import Plan
    from memtrain.planner import ModelSpec, make_plan
    from memtrain.recipe import Recipe, RecipeSection
    from memtrain.training.trainer import FitResult, Trainer

__version__ = "0.1.0"

_HOMES = {
    "CausalLMTrainer": "memtrain.causal_lm.trainer",
    "FitResult": "memtrain.training.trainer",
    "MemtrainError": "memtrain.errors",
    "ModelSpec": "memtrain.planner",
    "Plan": "memtrain.plan",
    "PlanError": "memtrain.errors",
    "Recipe": "memtrain.recipe",
    "RecipeError": "memtrain.errors",
    "RecipeSection": "memtrain.recipe",
    "Trainer": "memtrain.training.trainer",
    "Unsupported": "memtrain.errors",
    "make_plan": "memtrain.planner",
}


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'memtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # the next lookup finds it without this function
    return value


__all__ = [
    "CausalLMTrainer",
    "FitResult",
    "MemtrainError",
    "ModelSpec",
    "Plan",
    "PlanError",
    "Recipe",
    "RecipeError",
    "RecipeSection",
    "Trainer",
    "Unsupported",
    "make_plan",
]
