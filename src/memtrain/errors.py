"""Errors meant for users: each message names what to change.

`memtrain.cli` turns every one of these into a message and exit code 2, without a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

MAX_PROBLEMS_SHOWN = 20  # problems listed in a RecipeError's message; the rest are counted


class MemtrainError(Exception):
    """Base for errors caused by the user's input, not by a bug in memtrain."""


class RecipeError(MemtrainError):
    """One or more problems in a recipe; `problems` holds one line per problem, each naming its key."""

    def __init__(self, problems: list[str], source: str = "recipe") -> None:
        self.problems = list(problems)
        self.source = source
        shown = self.problems[:MAX_PROBLEMS_SHOWN]  # 10k unknown override keys made a 269 KB message
        lines = "\n".join(f"  - {p}" for p in shown)
        if len(self.problems) > len(shown):
            lines += f"\n  - ... and {len(self.problems) - len(shown):,} more (fix these first)"
        count = len(self.problems)
        super().__init__(f"{source}: {count:,} problem{'s' if count != 1 else ''}\n{lines}")


class PlanError(MemtrainError):
    """No plan satisfies the recipe and the memory budget."""


class Unsupported(MemtrainError):
    """A strategy cannot run in this environment (the reason says why and what to change)."""


class TrainingStopped(MemtrainError):
    """The run stopped itself (e.g. too many non-finite steps in a row) after saving a checkpoint."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' for the closest choice, or '' when nothing is close."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f' (did you mean "{matches[0]}"?)' if matches else ""


def shortened(value: Any, limit: int = 80) -> str:
    """The repr of a value echoed in a message, cut to `limit` characters (a huge or deeply nested value)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
