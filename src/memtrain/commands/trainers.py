"""Which `Trainer` class a command runs: the built-in causal-LM trainer, or the user's subclass named by
`--trainer path/to/file.py:MyTrainer` or `--trainer package.module:MyTrainer`.

The file is the user's own training code, run as `python file.py` would run it (as torchrun runs a
script); it is imported once per process under a module name of its own, so every rank of a torchrun
launch loads the same class. A file Python cannot read (not UTF-8, a syntax error), a file that is not
`.py`, or one that calls `sys.exit()` while imported (which made `train` exit 0 having trained nothing) is
a one-line `MemtrainError` naming `--trainer`; an exception the file's own code raises while it is
imported keeps its traceback (it is the user's code, and the traceback says where).

The trainer is resolved before the recipe is read: its `recipe_class` is the recipe's schema (the
built-in trainer's `model:` and `data:` sections are its own). `recipe_problems` is every check `memtrain
train` makes before it builds the model, for `memtrain validate` and for the one pass of `Recipe.load`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Iterator, Set
from pathlib import Path
from typing import Any

import torch

from memtrain.errors import MemtrainError, RecipeError
from memtrain.recipe import Recipe
from memtrain.strategies.blocks import model_shape
from memtrain.training import preflight
from memtrain.training.trainer import Trainer


def trainer_class(spec: str | None) -> type[Trainer]:
    """The class `spec` names (None: the built-in `CausalLMTrainer`); `MemtrainError` naming `--trainer`."""
    if spec is None:
        from memtrain.causal_lm.trainer import CausalLMTrainer

        return CausalLMTrainer
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise MemtrainError(
            f"--trainer: {spec!r} should be path/to/file.py:ClassName or package.module:ClassName"
        )
    if where.endswith(".py") or "/" in where or Path(where).is_file():
        module = _load_file(Path(where))
    else:
        module = _import(where)
    cls = getattr(module, name, None)
    if cls is None:
        raise MemtrainError(f"--trainer: {where} has no {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise MemtrainError(f"--trainer: {where}:{name} is not a subclass of memtrain.Trainer")
    return cls


def for_recipe(trainer: type[Trainer], recipe: Recipe) -> type[Trainer]:
    """`trainer`, or for the built-in trainer the class its data trains with (DPO for preference pairs)."""
    from memtrain.causal_lm.recipe import CausalLMRecipe
    from memtrain.causal_lm.trainer import CausalLMTrainer

    if trainer is CausalLMTrainer and isinstance(recipe, CausalLMRecipe):
        from memtrain.causal_lm.preference import trainer_for

        return trainer_for(recipe, trainer)
    return trainer


def _load_file(path: Path) -> object:
    if path.suffix != ".py":
        raise MemtrainError(f"--trainer: {path} is not a Python file (path/to/file.py:ClassName)")
    if not path.is_file():
        raise MemtrainError(f"--trainer: no file {path}")
    module_name = f"memtrain_user_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:  # also how Python reports a file that is not UTF-8
        del sys.modules[module_name]
        raise MemtrainError(f"--trainer: {path}, line {exc.lineno}: {exc.msg}") from None
    except SystemExit as exc:  # sys.exit() while imported: exit 0 would read as a finished run
        del sys.modules[module_name]
        raise MemtrainError(
            f"--trainer: {path} called sys.exit({exc.code!r}) while it was imported; keep the script's own "
            "entry point under `if __name__ == '__main__':`"
        ) from None
    except Exception:
        del sys.modules[module_name]
        raise
    return module


@contextlib.contextmanager
def no_exit_from_hooks() -> Iterator[None]:
    """While the trainer's code runs (building, setup, `fit`, close): a `SystemExit` it raises (a hook
    calling `sys.exit(0)` ended `train` with exit 0 and no message, read as a finished run) is a one-line
    `MemtrainError` naming the hook, exit 2."""
    try:
        yield
    except SystemExit as exc:
        raise MemtrainError(
            f"--trainer: {_exiting_hook(exc)} called sys.exit({exc.code!r}), which would end memtrain as if it had "
            "finished; a hook that must stop the run raises an exception instead"
        ) from None


def _exiting_hook(exc: BaseException) -> str:
    """The outermost function outside memtrain on the way to `exc` (the hook memtrain called), with its file
    and line; "the trainer" when memtrain's own code raised it."""
    package = Path(__file__).resolve().parents[1]
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in frames:
        if package not in Path(frame.filename).resolve().parents:
            return f"hook {frame.name} ({frame.filename}, line {frame.lineno})"
    return "the trainer"


def _import(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MemtrainError(f"--trainer: cannot import {name} ({exc})") from None
    except SystemExit as exc:  # as in `_load_file`
        raise MemtrainError(
            f"--trainer: {name} called sys.exit({exc.code!r}) while it was imported"
        ) from None


def recipe_schema(spec: str | None) -> dict[str, Any]:
    """`memtrain schema`: the JSON schema of the trainer's recipe (the built-in trainer's lists its data
    sources too)."""
    from memtrain.causal_lm.recipe import CausalLMRecipe
    from memtrain.causal_lm.sources import schema_with_sources

    recipe_class = trainer_class(spec).recipe_class
    schema = recipe_class.editor_schema()
    return schema_with_sources(schema) if issubclass(recipe_class, CausalLMRecipe) else schema


def recipe_problems(recipe: Recipe, trainer: type[Trainer], skip: Set[str] = frozenset()) -> list[str]:
    """Every problem `memtrain train` would find before it builds the model, found without building or
    writing anything: the trainer's own recipe part (`Trainer.recipe_problems`: the built-in trainer's
    model config and data), then the run's own checks (`training.preflight.recipe_problems`). Sections
    named in `skip` failed validation and stand at their defaults, so they are not checked."""
    return (
        trainer.recipe_problems(recipe, skip)
        + _tensor_parallel_problems(recipe, trainer)
        + _pipeline_problems(recipe, trainer)
        + _expert_parallel_problems(recipe, trainer)
        + preflight.recipe_problems(recipe, skip)
    )


def _tensor_parallel_problems(recipe: Recipe, trainer: type[Trainer]) -> list[str]:
    """A trainer without a tensor-parallel plan (`Trainer.tensor_parallel_plan` not overridden) and tp > 1."""
    tp = recipe.strategies.mesh.tp
    if tp == 1 or trainer.tensor_parallel_plan is not Trainer.tensor_parallel_plan:
        return []
    return [
        f"strategies.mesh.tp: {trainer.__name__} has no tensor-parallel plan (override "
        "Trainer.tensor_parallel_plan(model)); set strategies.mesh.tp: 1"
    ]


def _expert_parallel_problems(recipe: Recipe, trainer: type[Trainer]) -> list[str]:
    """A trainer without an expert-parallel plan (`Trainer.expert_parallel_plan` not overridden) and ep > 1."""
    ep = recipe.strategies.mesh.ep
    if ep == 1 or ep == "auto" or trainer.expert_parallel_plan is not Trainer.expert_parallel_plan:
        return []
    return [
        f"strategies.mesh.ep: {trainer.__name__} has no expert-parallel plan (override "
        "Trainer.expert_parallel_plan(model)); set strategies.mesh.ep: 1"
    ]


def _pipeline_problems(recipe: Recipe, trainer: type[Trainer]) -> list[str]:
    """A trainer that cannot split its model into pipeline stages (no `Trainer.pipeline_split`) and pp > 1."""
    pp = recipe.strategies.mesh.pp
    if pp == 1 or trainer.pipeline_split is not None:
        return []
    return [
        f"strategies.mesh.pp: {trainer.__name__} cannot split its model into pipeline stages (only the "
        "built-in causal-LM trainer does); set strategies.mesh.pp: 1"
    ]


def load_checked_recipe(path: str | Path, overrides: list[str], trainer: type[Trainer]) -> Recipe:
    """The trainer's recipe (`trainer.recipe_class.load`), and when the schema finds problems, also every
    later check (`recipe_problems`) on the sections that validated: every mistake in one pass."""
    return trainer.recipe_class.load(
        path, overrides, later_checks=lambda recipe, failed: recipe_problems(recipe, trainer, failed)
    )


def validate(recipe: Recipe, source: str, trainer: type[Trainer]) -> str:
    """`memtrain validate`: every check of `memtrain train` before step 1 that writes nothing, in the order
    train meets them (the `--trainer` file, then the recipe, then the model); the model in words, or a
    `RecipeError` listing every problem."""
    problems = recipe_problems(recipe, trainer)
    if problems:
        raise RecipeError(problems, source)
    return _validated_model(recipe, source, trainer)


def _validated_model(recipe: Recipe, source: str, trainer: type[Trainer]) -> str:
    """The model part of `memtrain validate`'s line, after the checks that need the model on the meta
    device (`training.preflight.model_problems`). The built-in trainer's model is built from its config
    alone (constructing the trainer would read the data)."""
    from memtrain.causal_lm.recipe import CausalLMRecipe
    from memtrain.causal_lm.trainer import CausalLMTrainer

    if trainer is CausalLMTrainer:
        from transformers import AutoModelForCausalLM

        from memtrain.causal_lm.trainer import build_config, weights_note

        causal = CausalLMRecipe.adopt(recipe)
        config = build_config(causal)
        described = config.model_type + weights_note(causal)
        problems = preflight.model_problems(
            recipe,
            lambda: AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False),
        )
    else:
        from memtrain.distributed import shutdown

        built = trainer(recipe)
        try:
            described = describe_model(built)
            problems = preflight.model_problems(recipe, built.build_model)
        finally:
            shutdown(built.env)
    if problems:
        raise RecipeError(problems, source)
    return described


def describe_model(trainer: Trainer) -> str:
    """A line for `memtrain validate`: the trainer's model as the planner will see it (built on the meta
    device), after checking that `planning_batch` works."""
    with torch.device("meta"):
        model = trainer.build_model()
    shape = model_shape(model, trainer.blocks(model))
    trainer.planning_batch(1)
    return (
        f"{type(trainer).__name__}: {shape.numel:,} parameters ({shape.trainable_numel:,} trainable), "
        f"{shape.num_blocks} blocks"
    )
