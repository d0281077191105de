"""How far memtrain's predictions were measured from real GPU runs, and the margin that follows from it.

Why a measured margin and not a fixed one: a plan's reserved bytes are held to the usable memory with a
margin for what the prediction gets wrong. A fixed share chosen before anything was measured (3%, on top of
a 10% safety fraction) refused runs that others trained and that memtrain predicted within 2% (torchtitan's
8B context-parallel rows at 88% of the card). The error that matters is the under-prediction: a run that
holds more than predicted is the one that runs out. `scripts/bench_published.py --write-error` replays the
published GPU runs whose levers memtrain has, and writes the largest under-prediction it measured (and the
largest over-prediction, for the record) to `prediction_error.json` beside this file; `planner.reserved_margin`
defaults to it, never below `MARGIN_FLOOR` (a handful of runs is not the whole distribution). The GPU check
(scripts/gpu_check.sh) adds its own measurements by the same file when it runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from memtrain.errors import MemtrainError

ERROR_FILE = Path(__file__).with_name("prediction_error.json")
MARGIN_FLOOR = 0.02  # the least margin, however well the replayed runs were predicted
MAX_ERROR = 0.5  # a file claiming more is not a measurement of this model


@dataclass(frozen=True)
class MeasuredError:
    """The largest relative errors measured: (published - predicted) / predicted, on each run's counter."""

    under_prediction: float  # the most a run held above its prediction (0: none held more)
    over_prediction: float  # the most a prediction exceeded its run
    runs: int
    source: str

    @property
    def margin(self) -> float:
        return max(MARGIN_FLOOR, self.under_prediction)

    def to_json(self) -> dict[str, object]:
        return {
            "under_prediction": self.under_prediction,
            "over_prediction": self.over_prediction,
            "runs": self.runs,
            "source": self.source,
        }


def measured_error(path: Path = ERROR_FILE) -> MeasuredError:
    """The measured error in `path`, checked: a malformed file is an error naming it, not a silent default."""
    try:
        raw = json.loads(path.read_text())
        found = MeasuredError(
            float(raw["under_prediction"]),
            float(raw["over_prediction"]),
            int(raw["runs"]),
            str(raw["source"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MemtrainError(f"{path}: not a measured prediction error ({exc}); restore it from git") from None
    if not (0.0 <= found.under_prediction <= MAX_ERROR and 0.0 <= found.over_prediction <= MAX_ERROR):
        raise MemtrainError(f"{path}: errors must lie in [0, {MAX_ERROR}]; restore it from git")
    return found


def reserved_margin(configured: float | None) -> float:
    """`planner.reserved_margin`, or when the recipe leaves it unset the margin the measured error gives."""
    return measured_error().margin if configured is None else configured


def write_measured_error(found: MeasuredError, path: Path = ERROR_FILE) -> None:
    path.write_text(json.dumps(found.to_json(), indent=2) + "\n")
