"""Experiment loggers: where each step's metrics row goes (`output.loggers` in the recipe).

`metrics.jsonl` is enough for scripts and tests, but people watch runs in TensorBoard, Weights & Biases
or MLflow. The trainer hands every row to each logger through one two-method interface (`log`, `close`),
so a new tracker is one adapter here and one name in the recipe. The optional packages are checked
before training starts, so a missing one is a `RecipeError` naming the pip extra, not a crash after the
first hour. Only rank 0 logs. Nothing here needs the network: W&B runs offline and MLflow writes a file
store inside the run directory.

Nested values of a row become slash-separated tags (`tracked.at_peak.weights` -> `memory/weights`);
values that are not numbers (the peak's phase and module names) go only to metrics.jsonl.

Runs whose stderr is not a terminal (batch jobs, `| tee`) get no progress bar; `ProgressLine` prints a
plain `[memtrain] step N/T ...` line every `output.log_every_s` seconds instead.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import numbers
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

from memtrain.errors import RecipeError, did_you_mean
from memtrain.memory import format_bytes
from memtrain.recipe import Recipe
from memtrain.training.metrics import MetricsLog

LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
# logger name -> (the module it imports, the memtrain extra that installs it)
_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
# the tag prefixes of the memory tracker's nested values
_TAG_PREFIXES = (("tracked/at_peak/", "memory/"), ("tracked/", "memory/"))
MLFLOW_EXPERIMENT = "memtrain"


class Logger(Protocol):
    """Receives each logged metrics row (rank 0 only) and is closed once at the end of `fit`."""

    def log(self, step: int, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------------ checks


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken parent package, or a module without a spec
        return True


def _install_hint(name: str) -> str:
    module, extra = _PACKAGES[name]
    return f"output.loggers: {name!r} needs the {module} package: pip install 'memtrain[{extra}]'"


def check_loggers(names: Sequence[str]) -> None:
    """Raise a `RecipeError` (naming `output.loggers`) for an unknown name or a package not installed."""
    problems = []
    for name in names:
        if name not in LOGGER_NAMES:
            problems.append(
                f"output.loggers: unknown logger {name!r}; choose from {', '.join(LOGGER_NAMES)}"
                + did_you_mean(name, LOGGER_NAMES)
            )
        elif name in _PACKAGES and _missing(_PACKAGES[name][0]):
            problems.append(_install_hint(name))
    if problems:
        raise RecipeError(problems)


def _import(name: str, module: str) -> Any:
    """Import `module` for logger `name`; a failed import is a `RecipeError` with the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise RecipeError([f"{_install_hint(name)} (import failed: {error})"]) from error


# ------------------------------------------------------------------------------------ rows


def _flatten(row: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in row.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def _tag(path: str) -> str:
    for old, new in _TAG_PREFIXES:
        if path.startswith(old):
            return new + path[len(old) :]
    return path


def scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The row's numbers by tag (`tracked.at_peak.weights` -> `memory/weights`); `step` is the x-axis,
    not a scalar, and text values are left out."""
    return {
        _tag(path): float(value)
        for path, value in _flatten(row)
        if path != "step" and isinstance(value, numbers.Real)
    }


# ------------------------------------------------------------------------------------ adapters


class TensorBoardLogger:
    """One scalar per number of the row, in `<run_dir>/tensorboard`."""

    def __init__(self, log_dir: Path, resume_step: int | None) -> None:
        tensorboard = _import("tensorboard", "torch.utils.tensorboard")
        # on resume, TensorBoard hides the old run's events from resume_step + 1 on (like metrics.jsonl)
        purge_step = resume_step + 1 if resume_step is not None else None
        self._writer = tensorboard.SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run in offline mode under `<run_dir>/wandb` (`wandb sync` uploads it)."""

    def __init__(self, run_dir: Path, recipe: Recipe) -> None:
        wandb = _import("wandb", "wandb")
        self._run = wandb.init(
            mode="offline",
            dir=str(run_dir),
            project="memtrain",
            name=recipe.run.name,
            config=recipe.to_dict(),
            # leave sys.stdout/sys.stderr alone: the trainer's progress output checks isatty()
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self._run.log(scalars(row), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowLogger:
    """An MLflow run in a file store at `<run_dir>/mlruns` (`mlflow ui --backend-store-uri` shows it)."""

    def __init__(self, run_dir: Path, recipe: Recipe) -> None:
        # MLflow 3 refuses file stores unless this is set; a user's explicit setting wins
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = _import("mlflow", "mlflow")
        self._client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
        experiment = self._client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(MLFLOW_EXPERIMENT)
        )
        self._run_id: str = self._client.create_run(experiment_id, run_name=recipe.run.name).info.run_id
        self._client.log_dict(self._run_id, recipe.to_dict(), "recipe.json")
        self._metric = _import("mlflow", "mlflow.entities").Metric

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(tag, value, now_ms, step) for tag, value in scalars(row).items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class JsonlLogger:
    """metrics.jsonl, exactly as `MetricsLog` writes it (rows past a resumed step are dropped)."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.metrics = MetricsLog(path, resume_step)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self.metrics.write(dict(row))

    def close(self) -> None:
        self.metrics.close()


_Builder = Callable[[Path, Recipe, int | None], Logger]
_BUILDERS: dict[str, _Builder] = {
    "jsonl": lambda run_dir, recipe, resume: JsonlLogger(run_dir / "metrics.jsonl", resume),
    "tensorboard": lambda run_dir, recipe, resume: TensorBoardLogger(run_dir / "tensorboard", resume),
    "wandb": lambda run_dir, recipe, resume: WandbLogger(run_dir, recipe),
    "mlflow": lambda run_dir, recipe, resume: MlflowLogger(run_dir, recipe),
}


def make_loggers(
    names: Sequence[str], run_dir: Path, recipe: Recipe, is_main: bool, resume_step: int | None = None
) -> list[Logger]:
    """The loggers named in `output.loggers` (each once), on rank 0; an empty list on other ranks.
    Every rank checks the packages first, so all ranks fail alike. `resume_step`: the step a resumed
    run continues from (None for a fresh run)."""
    check_loggers(names)
    if not is_main:
        return []
    loggers: list[Logger] = []
    try:
        for name in dict.fromkeys(names):
            loggers.append(_BUILDERS[name](run_dir, recipe, resume_step))
    except BaseException:
        close_loggers(loggers)
        raise
    return loggers


def log_row(loggers: Sequence[Logger], row: Mapping[str, Any]) -> None:
    for logger in loggers:
        logger.log(int(row["step"]), row)


def close_loggers(loggers: Sequence[Logger]) -> None:
    """Close every logger, even when one of them raises."""
    with contextlib.ExitStack() as stack:
        for logger in loggers:
            stack.callback(logger.close)


# ------------------------------------------------------------------------------------ plain progress


def wants_progress_line(setting: str, every_s: float, is_main: bool) -> bool:
    """Plain lines on rank 0 when there is no terminal to draw a bar on, or the bar is off."""
    return is_main and every_s > 0 and (setting == "off" or not sys.stderr.isatty())


def format_progress(row: Mapping[str, Any], total: int) -> str:
    return (
        f"[memtrain] step {row['step']}/{total} loss {row['loss']:.4f} lr {row['lr']:.3g} "
        f"tok/s {row['tokens_per_s']:.0f} peak {format_bytes(int(row['peak_memory_bytes']))}"
    )


class ProgressLine:
    """Prints `format_progress` to stderr at most every `every_s` seconds, and always for the last step."""

    def __init__(
        self,
        total: int,
        every_s: float,
        enabled: bool,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.every_s, self.enabled = total, every_s, enabled
        self._stream, self._clock = stream, clock
        self._last: float | None = None

    def _due(self, step: int, now: float) -> bool:
        return step >= self.total or self._last is None or now - self._last >= self.every_s

    def update(self, row: Mapping[str, Any]) -> None:
        now = self._clock()
        if not self.enabled or not self._due(int(row["step"]), now):
            return
        self._last = now
        print(format_progress(row, self.total), file=self._stream or sys.stderr, flush=True)
