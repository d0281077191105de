"""Per-step metrics: a JSONL file in the run directory, a progress bar, and the end-of-run summary.

Only rank 0 writes. The JSONL survives a crash line by line; on resume, rows past the resumed step are
moved to an abandoned file by the run directory (`memtrain.run.metrics_rows`: they belong to a trajectory
a rollback abandoned, or to steps a killed run logged after its last checkpoint) so the file reads as one
uninterrupted run and no row is lost. The rows are written by the jsonl logger (`memtrain.loggers`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def make_progress(setting: str, total: int, initial: int, enabled: bool) -> tqdm | None:
    """A tqdm bar on rank 0: `on`, `off`, or `auto` (only when stderr is a terminal)."""
    show = enabled and (setting == "on" or (setting == "auto" and sys.stderr.isatty()))
    if not show:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
