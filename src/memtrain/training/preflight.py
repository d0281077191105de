"""Pre-flight: what would stop a run late, found before step 1.

Why: an output directory that cannot take a checkpoint (a file in its place, no write permission, a
full disk) fails at the first save, after the steps are done, and the steps are lost. A simulated memory
budget smaller than the model's own weights fails inside the first step with an out-of-memory traceback.
Each of these is known before step 1, so each becomes one line naming the recipe key to change.

- `recipe_problems(recipe)`: the checks `memtrain train` makes before it builds the model that need no
  model (the output directory, batch divisibility, a DeepSpeed JSON, quantisation without adapters, and
  the planner's rules: choices that leave no plan able to run, whatever the memory, `planner.rules`;
  a logger whose package is not installed);
  `memtrain validate` runs them too. They write nothing and create no directory.
- `model_problems(recipe, build_model)`: for `memtrain validate`, with the model built on the meta
  device: `memory.budget` against the weights of a pinned plan (an open recipe is judged by the planner).
- `run_problems(...)`: at the end of `Trainer.setup()`, on rank 0, with the model built: the same
  directory checks, free disk for one checkpoint (the plan's weights and optimizer states), and
  `memory.budget` against the weights; `agree` makes every rank raise when rank 0 found a problem.

Writability is `os.access` (which honours read-only mounts, also for root): `_writable` is the one probe.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Set
from pathlib import Path

import torch
from torch import nn

from memtrain.errors import MemtrainError, RecipeError, Unsupported
from memtrain.memory.footprint import Footprint, ModelShape
from memtrain.plan import Plan, arranged, is_open, mesh_of, per_rank_batch, pinned_plan, quantization_of
from memtrain.planner import rules
from memtrain.planner.result import PlanResult
from memtrain.recipe import Recipe
from memtrain.run import RunLayout
from memtrain.strategies.adapters import check_targets
from memtrain.strategies.blocks import model_shape
from memtrain.training import deepspeed_checks
from memtrain.training.loggers import check_loggers


def recipe_problems(recipe: Recipe, skip: Set[str] = frozenset()) -> list[str]:
    """Problems found without a model, for the recipe sections not named in `skip` (sections that failed
    validation and stand at their defaults)."""
    checks: list[tuple[set[str], Callable[[Recipe], list[str]]]] = [
        ({"run", "checkpoint"}, directory_problems),
        ({"batch", "strategies"}, _batch_problems),
        ({"strategies"}, _mesh_problems),
        ({"model", "adapters"}, _quantization_problems),
        ({"strategies", "batch", "train"}, deepspeed_checks.recipe_problems),
        ({"strategies", "batch", "train", "model", "adapters"}, rules.rule_problems),
        ({"output"}, _logger_problems),
    ]
    return [line for sections, check in checks if not sections & skip for line in check(recipe)]


def directory_problems(recipe: Recipe) -> list[str]:
    """Why `run.output_dir` (or runs/<run.name>) cannot take the run's files and checkpoints, if it cannot."""
    run_dir = recipe.output_path()
    try:
        return _directory_problems(run_dir)
    except OSError as exc:  # a name the filesystem refuses, a permission on a parent
        return [f"run.output_dir: cannot use {str(run_dir)[:200]} ({exc.strerror or exc})"]


def _directory_problems(run_dir: Path) -> list[str]:
    if run_dir.exists() and not run_dir.is_dir():
        return [f"run.output_dir: {run_dir} is a file, not a directory; set run.output_dir to a directory"]
    existing = _existing_ancestor(run_dir)
    if not existing.is_dir():
        return [
            f"run.output_dir: cannot create {run_dir}: {existing} is a file; set run.output_dir elsewhere"
        ]
    if not _writable(existing):
        return [
            f"run.output_dir: {existing} is not writable; set run.output_dir to a directory you can write, "
            "or change its permissions"
        ]
    checkpoints = RunLayout(run_dir).checkpoints
    if checkpoints.exists() and not (checkpoints.is_dir() and _writable(checkpoints)):
        return [
            f"run.output_dir: {checkpoints} is not a writable directory, and checkpoints are saved there; "
            "fix its permissions or set run.output_dir to another directory"
        ]
    return []


def _existing_ancestor(path: Path) -> Path:
    """`path` itself when it exists, else its nearest existing parent (what a mkdir would write into)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK | os.X_OK)


def _batch_problems(recipe: Recipe) -> list[str]:
    if isinstance(recipe.batch.micro_size, int) and recipe.batch.micro_size > recipe.batch.global_size:
        return []  # the recipe's own cross-check says so
    try:
        data_parallel = mesh_of(recipe, _world_size()).dp_size
    except RecipeError:
        return []  # `_mesh_problems` says why
    return _problems_of(lambda: per_rank_batch(recipe, data_parallel))


def _mesh_problems(recipe: Recipe) -> list[str]:
    """The mesh `train` would arrange `WORLD_SIZE` ranks in, and what of it cannot run on this device."""
    here = rules.this_device()
    return _problems_of(lambda: arranged(here, recipe))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _logger_problems(recipe: Recipe) -> list[str]:
    """A logger of `output.loggers` whose package is not installed (the train-only set-up has none)."""
    return _problems_of(lambda: check_loggers(recipe.output.loggers))


def _quantization_problems(recipe: Recipe) -> list[str]:
    return _problems_of(lambda: quantization_of(recipe))


def _problems_of(check: Callable[[], object]) -> list[str]:
    try:
        check()
    except RecipeError as exc:
        return exc.problems
    return []


def model_problems(recipe: Recipe, build_model: Callable[[], nn.Module]) -> list[str]:
    """The checks that need the model, built on the meta device by `build_model` only when one applies:
    adapter targets that match no module, and `budget_problem` for the recipe's pinned plan on this
    device (a plan this device cannot run is `planner.rules`' to report, in `recipe_problems`)."""
    targets = recipe.adapters.target_modules
    check_adapters = recipe.adapters.kind != "none" and not isinstance(targets, str)
    plan = _pinned_here(recipe) if recipe.memory.budget is not None and not is_open(recipe) else None
    if not check_adapters and plan is None:
        return []
    with torch.device("meta"):
        model = build_model()
    problems = []
    if check_adapters:
        try:
            check_targets(model, tuple(targets))
        except Unsupported as exc:
            problems.append(str(exc))
    problem = budget_problem(recipe, plan, model_shape(model, [])) if plan is not None else None
    return problems + ([problem] if problem is not None else [])


def _pinned_here(recipe: Recipe) -> Plan | None:
    """The recipe's pinned plan on this device, or None when this device cannot run it."""
    try:
        return pinned_plan(recipe, rules.this_device())
    except MemtrainError:
        return None


def run_problems(recipe: Recipe, plan: Plan, planned: PlanResult | None, model: nn.Module) -> list[str]:
    """The pre-flight of a run whose model is built (`model`: unwrapped, this rank's view)."""
    problems = directory_problems(recipe)
    shape = model_shape(model, [])
    budget = budget_problem(recipe, plan, shape)
    if budget is not None:
        problems.append(budget)
    saves = recipe.checkpoint.every > 0 or recipe.checkpoint.at_end
    if saves and not problems:
        problems += _disk_problems(recipe, checkpoint_bytes(plan, shape, planned))
    return problems


def agree(problems: list[str], any_rank: bool) -> None:
    """Raise on every rank when any rank (rank 0) found problems (`any_rank`: the ranks' agreed flag)."""
    if any_rank:
        raise RecipeError(
            problems or ["run.output_dir: rank 0 found a problem before step 1 (see its error)"]
        )


def checkpoint_bytes(plan: Plan, shape: ModelShape, planned: PlanResult | None) -> int:
    """Bytes of one checkpoint over all ranks: the weights and optimizer states the plan keeps. The
    planner's own figures when it chose the plan; otherwise the precision's and the optimizer-state
    strategy's estimates for `shape` (a quantised base is not saved: only what trains is counted)."""
    chosen = planned.chosen if planned is not None else None
    if chosen is not None:
        weights, _, states = chosen.states.stored
        return (weights + states) * (1 if plan.sharding.replicated else plan.world_size)
    saved = shape if plan.quantization.name == "none" else shape.trainable
    stored = plan.sharding.as_stored(plan.precision)  # frozen parameters in the dtype the run keeps them
    fp = plan.update_states.estimate(saved, stored.estimate(saved, Footprint()))
    return fp.weights + fp.optimizer_states


def weight_bytes(plan: Plan, shape: ModelShape) -> int:
    """The weights one rank holds in `plan` (its share when the plan shards them)."""
    weights = plan.sharding.as_stored(plan.precision).estimate(shape, Footprint()).weights
    return weights // (1 if plan.sharding.replicated else plan.world_size)


def budget_problem(recipe: Recipe, plan: Plan, shape: ModelShape) -> str | None:
    """`memory.budget` below the weights alone (no step could run; the planner also needs room for
    gradients, optimizer states and activations). Not judged for a quantised base (its bytes depend on
    which linears are quantised)."""
    budget = recipe.memory.budget
    if budget is None or plan.quantization.name != "none":
        return None
    weights = weight_bytes(plan, shape)
    if int(budget) >= weights:
        return None
    return (
        f"memory.budget: {int(budget):,} bytes is less than the {weights:,} bytes of the weights alone in "
        f"this plan ({plan.precision.name}); raise memory.budget well above that (gradients, optimizer "
        "states and activations need room too)"
    )


def _disk_problems(recipe: Recipe, needed: int) -> list[str]:
    where = _existing_ancestor(recipe.output_path())
    free = shutil.disk_usage(where).free
    if free >= needed:
        return []
    return [
        f"checkpoint.every: one checkpoint of this plan takes about {needed / 2**30:.2f} GiB and {where} has "
        f"{free / 2**30:.2f} GiB free; free some space or set run.output_dir on a larger disk"
    ]
