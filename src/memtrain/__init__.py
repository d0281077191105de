"""memtrain: LLM training that knows, before step 1, what fits in GPU memory and what is fastest.

Public names: `Trainer` (subclass it), `CausalLMTrainer` (any transformers causal-LM config),
`Recipe` / `load_recipe` (typed YAML recipes), `Plan` (the strategies a run trains with) and `make_plan`
(the planner's choice for a trainer's `model_spec()` when the recipe leaves choices open).
"""

from memtrain.errors import MemtrainError, PlanError, RecipeError, Unsupported
from memtrain.plan import Plan
from memtrain.planner import ModelSpec, make_plan
from memtrain.recipe import Recipe, load_recipe
from memtrain.training.trainer import FitResult, Trainer

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # CausalLMTrainer imports transformers (about a second); load it only when asked for.
    if name == "CausalLMTrainer":
        from memtrain.causal_lm.trainer import CausalLMTrainer

        return CausalLMTrainer
    raise AttributeError(name)


__all__ = [
    "CausalLMTrainer",
    "FitResult",
    "MemtrainError",
    "ModelSpec",
    "Plan",
    "PlanError",
    "Recipe",
    "RecipeError",
    "Trainer",
    "Unsupported",
    "load_recipe",
    "make_plan",
]
