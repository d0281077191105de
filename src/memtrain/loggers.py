"""Experiment loggers by name (`output.loggers`): the registry and the built-in ones.

`metrics.jsonl` is enough for scripts and tests, but people watch runs in TensorBoard, Weights & Biases
or MLflow. The trainer hands every metrics row to each logger through one two-method interface (`log`,
`close`). Each logger is declared once, as a `LoggerEntry` in `LOGGERS`: its name, the optional package it
needs and the pip extra that installs it (checked before training starts, so a missing one is a
`RecipeError` naming the extra, not a crash after the first hour), and how it is built. A new logger is
one file plus one line, `LOGGERS.register(LoggerEntry("mine", MyLogger))`.

Why here, below the recipe: the recipe validates `output.loggers` against these names as it validates
every other key, and lists them in its JSON schema, so nothing here may import the recipe or the
trainer. A builder gets a `LoggerContext` instead: the paths it writes to (filled by the trainer,
`memtrain.training.loggers.logger_context`: a logger never computes names inside the run directory), the
run's name and the recipe as a plain dict. Nothing here needs the network: W&B runs offline and MLflow
writes a file store inside the run directory.

Nested values of a row become slash-separated tags (`tracked.at_peak.weights` -> `memory/weights`);
values that are not numbers (the peak's phase and module names) go only to metrics.jsonl.
"""

from __future__ import annotations

import importlib
import importlib.util
import numbers
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from memtrain import json_out
from memtrain.errors import RecipeError
from memtrain.registry import Registry

# the tag prefixes of the memory tracker's nested values
_TAG_PREFIXES = (("tracked/at_peak/", "memory/"), ("tracked/", "memory/"))
MLFLOW_EXPERIMENT = "memtrain"


class Logger(Protocol):
    """Receives each logged metrics row (rank 0 only) and is closed once at the end of `fit`."""

    def log(self, step: int, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class LoggerContext:
    """What a builder gets: where this logger writes, and what the run is."""

    metrics_file: Path  # the run's metrics.jsonl
    recipe_file: Path  # the run's resolved recipe (MLflow names its copy after it)
    directory: Path  # a folder of the run this logger owns (`own_folder`), else the run directory
    run_name: str
    recipe: dict[str, Any]  # the resolved recipe, as recipe.json holds it
    resume_step: int | None  # the step a resumed run continues from; None for a fresh run


@dataclass(frozen=True)
class LoggerEntry:
    """One logger: `build(context)` makes it; `package` (installed by `pip install 'memtrain[extra]'`) is
    checked before training starts; `own_folder` gives it a folder of the run named after it."""

    name: str
    build: Callable[[LoggerContext], Logger]
    package: str | None = None
    extra: str | None = None
    own_folder: bool = False

    def install_hint(self) -> str:
        install = f"pip install 'memtrain[{self.extra}]'"
        return f"output.loggers: {self.name!r} needs the {self.package} package: {install}"

    def missing(self) -> bool:
        """Whether its optional package is not installed."""
        if self.package is None:
            return False
        try:
            return importlib.util.find_spec(self.package) is None
        except (ImportError, ValueError):  # a broken parent package, or a module without a spec
            return True


LOGGERS: Registry[LoggerEntry] = Registry("output.loggers")


def _import(logger: str, module: str) -> Any:
    """Import `module` for `logger`; a failed import is a `RecipeError` with the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise RecipeError([f"{LOGGERS.get(logger).install_hint()} (import failed: {error})"]) from error


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


# ------------------------------------------------------------------------------------ built-in loggers


class JsonlLogger:
    """metrics.jsonl, one strict-JSON row per line, flushed as written (it survives a crash line by line).
    A fresh run starts the file empty; a resumed one appends (the run directory has moved the rows past
    the resumed step aside: `memtrain.run.metrics_rows`)."""

    def __init__(self, context: LoggerContext) -> None:
        path = context.metrics_file
        path.parent.mkdir(parents=True, exist_ok=True)
        if context.resume_step is None:  # a new empty file (never truncating one a hard link shares)
            json_out.write_bytes_atomic(path, b"")
        self._handle: TextIO = open(path, "a", encoding="utf-8")

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self._handle.write(json_out.dumps(dict(row)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


class TensorBoardLogger:
    """One scalar per number of the row, in the logger's own folder."""

    def __init__(self, context: LoggerContext) -> None:
        tensorboard = _import("tensorboard", "torch.utils.tensorboard")
        # on resume, TensorBoard hides the old run's events from resume_step + 1 on (like metrics.jsonl)
        resume = context.resume_step
        purge_step = resume + 1 if resume is not None else None
        self._writer = tensorboard.SummaryWriter(log_dir=str(context.directory), purge_step=purge_step)

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run in offline mode (under `wandb/` of its directory; `wandb sync` uploads it)."""

    def __init__(self, context: LoggerContext) -> None:
        wandb = _import("wandb", "wandb")
        self._run = wandb.init(
            mode="offline",
            dir=str(context.directory),
            project="memtrain",
            name=context.run_name,
            config=context.recipe,
            # leave sys.stdout/sys.stderr alone: the trainer's progress output checks isatty()
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        self._run.log(scalars(row), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowLogger:
    """An MLflow run in a file store at `mlruns/` of its directory (`mlflow ui --backend-store-uri`)."""

    def __init__(self, context: LoggerContext) -> None:
        # MLflow 3 refuses file stores unless this is set; a user's explicit setting wins
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = _import("mlflow", "mlflow")
        self._client = mlflow.MlflowClient(tracking_uri=(context.directory / "mlruns").as_uri())
        experiment = self._client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(MLFLOW_EXPERIMENT)
        )
        self._run_id: str = self._client.create_run(experiment_id, run_name=context.run_name).info.run_id
        self._client.log_dict(self._run_id, context.recipe, context.recipe_file.name)
        self._metric = _import("mlflow", "mlflow.entities").Metric

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(tag, value, now_ms, step) for tag, value in scalars(row).items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


LOGGERS.register(LoggerEntry("jsonl", JsonlLogger))
LOGGERS.register(LoggerEntry("tensorboard", TensorBoardLogger, "tensorboard", "tensorboard", own_folder=True))
LOGGERS.register(LoggerEntry("wandb", WandbLogger, "wandb", "wandb"))
LOGGERS.register(LoggerEntry("mlflow", MlflowLogger, "mlflow", "mlflow"))
