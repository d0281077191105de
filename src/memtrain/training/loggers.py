"""How the trainer uses the experiment loggers of `output.loggers` (`memtrain.loggers`), and the plain
progress line.

`check_loggers` runs on every rank before the model is built, so a logger whose package is missing
fails at once and alike everywhere. `make_loggers` builds them on rank 0 only, each with the context
`logger_context` fills from the run directory's layout: a logger never names a path inside it.

Runs whose stderr is not a terminal (batch jobs, `| tee`) get no progress bar; `ProgressLine` prints a
plain `[memtrain] step N/T ...` line every `output.log_every_s` seconds instead.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from memtrain.errors import RecipeError, did_you_mean
from memtrain.loggers import LOGGERS, Logger, LoggerContext, LoggerEntry
from memtrain.memory import format_bytes
from memtrain.recipe import Recipe
from memtrain.run import RunLayout
from memtrain.training.metrics import make_progress

# ------------------------------------------------------------------------------------ loggers


def check_loggers(names: Sequence[str]) -> None:
    """Raise a `RecipeError` (naming `output.loggers`) for an unknown name or a package not installed."""
    problems = []
    for name in names:
        if name not in LOGGERS:
            problems.append(
                f"output.loggers: unknown logger {name!r}; choose from {', '.join(LOGGERS.names())}"
                + did_you_mean(name, LOGGERS.names())
            )
        elif LOGGERS.get(name).missing():
            problems.append(LOGGERS.get(name).install_hint())
    if problems:
        raise RecipeError(problems)


def logger_context(
    entry: LoggerEntry, run_dir: Path, recipe: Recipe, resume_step: int | None
) -> LoggerContext:
    """What logger `entry` is built with: the paths it writes inside `run_dir` (the run's layout), the
    run's name and recipe, and the step a resumed run continues from (None for a fresh run)."""
    layout = RunLayout(run_dir)
    return LoggerContext(
        metrics_file=layout.metrics_file,
        recipe_file=layout.recipe_file,
        directory=layout.logger_dir(entry.name) if entry.own_folder else layout.root,
        run_name=recipe.run.name,
        recipe=recipe.to_dict(),
        resume_step=resume_step,
    )


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
            entry = LOGGERS.get(name)
            loggers.append(entry.build(logger_context(entry, run_dir, recipe, resume_step)))
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


class StepReport:
    """Where each step's metrics row goes: the loggers (every `train.log_every` steps, and every row with
    an eval loss), the progress bar and the plain progress line (rank 0 only; the other ranks' report
    holds nothing). A context manager: leaving it closes the loggers and the bar."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, is_main: bool, start: int, resume_step: int | None
    ) -> None:
        output, total = recipe.output, recipe.train.steps
        self.log_every = recipe.train.log_every
        self.loggers = make_loggers(output.loggers, run_dir, recipe, is_main, resume_step)
        self.bar = make_progress(output.progress, total, start, is_main)
        self.line = ProgressLine(
            total, output.log_every_s, wants_progress_line(output.progress, output.log_every_s, is_main)
        )

    def add(self, row: Mapping[str, Any]) -> None:
        if int(row["step"]) % self.log_every == 0 or "eval_loss" in row:
            log_row(self.loggers, row)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
        self.line.update(row)

    def __enter__(self) -> StepReport:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            close_loggers(self.loggers)
        finally:
            if self.bar is not None:
                self.bar.close()


# ------------------------------------------------------------------------------------ plain progress


def wants_progress_line(setting: str, every_s: float, is_main: bool) -> bool:
    """Plain lines on rank 0 when there is no terminal to draw a bar on, or the bar is off."""
    return is_main and every_s > 0 and (setting == "off" or not sys.stderr.isatty())


def format_progress(row: Mapping[str, Any], total: int) -> str:
    """The step's line; an evaluation's row adds its eval loss and perplexity."""
    evaluated = (
        f" eval_loss {row['eval_loss']:.4f} ppl {row['eval_perplexity']:.4g}" if "eval_loss" in row else ""
    )
    return (
        f"[memtrain] step {row['step']}/{total} loss {row['loss']:.4f} lr {row['lr']:.3g} "
        f"tok/s {row['tokens_per_s']:.0f} peak {format_bytes(int(row['peak_memory_bytes']))}{evaluated}"
    )


class ProgressLine:
    """Prints `format_progress` to stderr at most every `every_s` seconds, and always for the last step and
    an evaluation's step."""

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

    def _due(self, row: Mapping[str, Any], now: float) -> bool:
        if int(row["step"]) >= self.total or "eval_loss" in row or self._last is None:
            return True
        return now - self._last >= self.every_s

    def update(self, row: Mapping[str, Any]) -> None:
        now = self._clock()
        if not self.enabled or not self._due(row, now):
            return
        self._last = now
        print(format_progress(row, self.total), file=self._stream or sys.stderr, flush=True)
