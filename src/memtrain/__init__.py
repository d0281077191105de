"""memtrain: LLM training that knows, before step 1, what fits in GPU memory and what is fastest.

Public names: `Trainer` (subclass it), `CausalLMTrainer` (any transformers causal-LM config),
`Recipe` / `load_recipe` (typed YAML recipes), `Plan` / `make_plan` / `resolve_plan` (the choices a run
trains with, chosen by the planner when the recipe leaves them open).
"""

from memtrain.errors import MemtrainError, PlanError, RecipeError, Unsupported
from memtrain.plan import Plan, make_plan, resolve_plan
from memtrain.recipe import Recipe, load_recipe
from memtrain.trainer import FitResult, Trainer

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # CausalLMTrainer imports transformers (about a second); load it only when asked for.
    if name == "CausalLMTrainer":
        from memtrain.models import CausalLMTrainer

        return CausalLMTrainer
    raise AttributeError(name)


__all__ = [
    "CausalLMTrainer",
    "FitResult",
    "MemtrainError",
    "Plan",
    "PlanError",
    "Recipe",
    "RecipeError",
    "Trainer",
    "Unsupported",
    "load_recipe",
    "make_plan",
    "resolve_plan",
]
