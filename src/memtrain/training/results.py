"""What a run returns and reports: `FitResult`, the end-of-run summary and its one-line description.

Why apart from the loop: these are plain values that the CLI, the benchmarks and the tests read; keeping
them here keeps the loop's file about the loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memtrain.errors import MemtrainError
from memtrain.memory import format_bytes
from memtrain.plan import Plan

if TYPE_CHECKING:
    from memtrain.training.memory_monitor import MemoryMonitor


@dataclass
class FitResult:
    run_dir: Path
    plan: Plan
    losses: list[float] = field(default_factory=list)
    eval_losses: dict[int, float] = field(default_factory=dict)
    steps_done: int = 0
    preempted: bool = False  # stopped by a signal after a checkpoint
    stopped_by: str | None = None  # that signal: "SIGTERM" (exit 0) or "SIGINT" (Ctrl-C, exit 130)
    summary: dict[str, Any] = field(default_factory=dict)
    tokens_seen: int = 0  # loss tokens of the steps this call trained
    stopped_early: int | None = None  # the step after which `train.early_stopping` ended the run


@dataclass(frozen=True)
class StepTotals:
    loss_sum: torch.Tensor  # this rank's summed loss (float64 scalar)
    global_tokens: int  # loss tokens of the step over all ranks
    micro_batches: int


def summary_of(
    result: FitResult,
    plan: Plan,
    start: int,
    seconds: float,
    monitor: MemoryMonitor,
    skipped: tuple[int, int],
) -> dict[str, Any]:
    """summary.json: what the run did, from step `start` on, in `seconds`, ending with `plan`; `skipped`:
    the steps skipped, and of those the steps without a loss token (in this call)."""
    return {
        "steps": result.steps_done,
        "steps_this_run": result.steps_done - start,
        "first_loss": result.losses[0] if result.losses else None,
        "final_loss": result.losses[-1] if result.losses else None,
        "tokens_per_s": result.tokens_seen / seconds if seconds > 0 else 0.0,
        "seconds": seconds,
        "peak_memory_bytes": monitor.max_step_peak,
        "stopped_early": result.stopped_early,
        "skipped_steps": skipped[0],
        "empty_steps": skipped[1],
        "step_time": monitor.step_time,
        "plan": plan.to_dict(),
        "run_dir": str(result.run_dir),
    }


def check_token_count(reported: int | torch.Tensor, counted: int) -> None:
    """`loss()`'s token count must be `count_tokens()`'s (the step's normalisation uses the latter)."""
    if int(reported) != counted:
        raise MemtrainError(
            f"loss() reported {int(reported)} tokens but count_tokens() counted {counted}; "
            "override Trainer.count_tokens so the two agree (the loss must be a sum over these tokens)"
        )


def describe_summary(summary: dict[str, Any]) -> str:
    first, final = summary["first_loss"], summary["final_loss"]
    losses = f"loss {first:.4f} -> {final:.4f}" if first is not None else "no step run"
    return (
        f"[memtrain] {summary['steps']} steps ({summary['steps_this_run']} this run), {losses}, "
        f"{summary['tokens_per_s']:.0f} tokens/s, peak {format_bytes(summary['peak_memory_bytes'])}, "
        f"{summary['seconds']:.1f} s; outputs in {summary['run_dir']}"
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
