"""Which `Trainer` class a command runs: the built-in causal-LM trainer, or the user's subclass named by
`--trainer path/to/file.py:MyTrainer` or `--trainer package.module:MyTrainer`.

The file is the user's own training code, run as `python file.py` would run it (as torchrun runs a
script); it is imported once per process under a module name of its own, so every rank of a torchrun
launch loads the same class. A file Python cannot read (not UTF-8, a syntax error) is a one-line
`MemtrainError` naming `--trainer` and the line; an exception the file's own code raises while it is
imported keeps its traceback (it is the user's code, and the traceback says where).

`recipe_problems` is every check `memtrain train` makes before it builds the model, for `memtrain
validate` and for the one pass of `memtrain.recipe.load_recipe`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Set
from pathlib import Path

import torch

from memtrain.errors import MemtrainError, RecipeError
from memtrain.recipe import Recipe, load_recipe
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
    module = _load_file(Path(where)) if where.endswith(".py") or "/" in where else _import(where)
    cls = getattr(module, name, None)
    if cls is None:
        raise MemtrainError(f"--trainer: {where} has no {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise MemtrainError(f"--trainer: {where}:{name} is not a subclass of memtrain.Trainer")
    return cls


def _load_file(path: Path) -> object:
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
    except Exception:
        del sys.modules[module_name]
        raise
    return module


def _import(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MemtrainError(f"--trainer: cannot import {name} ({exc})") from None


def recipe_problems(recipe: Recipe, *, model: bool, skip: Set[str] = frozenset()) -> list[str]:
    """Every problem `memtrain train` would find before it builds the model, found without building or
    writing anything: with `model`, the built-in trainer's model config and data
    (`causal_lm.trainer.model_problems`); then the run's own checks (`training.preflight.recipe_problems`).
    Sections named in `skip` failed validation and stand at their defaults, so they are not checked."""
    problems = []
    if model and not {"model", "data"} & skip:
        from memtrain.causal_lm.trainer import model_problems

        problems += model_problems(recipe)
    return problems + preflight.recipe_problems(recipe, skip)


def load_checked_recipe(path: str | Path, overrides: list[str]) -> Recipe:
    """`load_recipe`, and when the schema finds problems, also every later check (`recipe_problems`) on
    the sections that validated, so the user sees every mistake in one pass."""
    return load_recipe(path, overrides, later_checks=_later_checks)


def _later_checks(recipe: Recipe, failed_sections: set[str]) -> list[str]:
    model = any(
        v is not None for v in (recipe.model.config, recipe.model.config_path, recipe.model.pretrained)
    )
    return recipe_problems(recipe, model=model, skip=failed_sections)


def validate(recipe: Recipe, source: str, spec: str | None) -> str:
    """`memtrain validate`: every check of `memtrain train` before step 1 that writes nothing, in the order
    train meets them (the `--trainer` file, then the recipe, then the model); the model in words, or a
    `RecipeError` listing every problem."""
    trainer_class(spec)
    problems = recipe_problems(recipe, model=spec is None)
    if problems:
        raise RecipeError(problems, source)
    return _validated_model(recipe, source, spec)


def _validated_model(recipe: Recipe, source: str, spec: str | None) -> str:
    """The model part of `memtrain validate`'s line, after the checks that need the model on the meta
    device (`training.preflight.model_problems`)."""
    if spec is None:
        from transformers import AutoModelForCausalLM

        from memtrain.causal_lm.trainer import build_config

        config = build_config(recipe)
        described = config.model_type
        problems = preflight.model_problems(recipe, lambda: AutoModelForCausalLM.from_config(config))
    else:
        from memtrain.distributed import shutdown

        trainer = trainer_class(spec)(recipe)
        try:
            described = describe_model(trainer)
            problems = preflight.model_problems(recipe, trainer.build_model)
        finally:
            shutdown(trainer.env)
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
