"""The rows of a run's metrics.jsonl past a step: found, and moved aside whole.

Why here: a resume truncates the file to its step (the rows past it belong to a trajectory a rollback
abandoned, or to steps a killed run logged after its last checkpoint), and a truncation moves those rows
into the run's `abandoned/` folder next to the checkpoints it sets aside, so no row is ever lost. Both are
the run directory's business (`memtrain.run.lineage`); the jsonl logger only appends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def abandon_rows_after(path: Path, step: int, to: Path) -> int:
    """Move the rows of `path` past `step` (and, from a line cut by a crash on, everything) to the end of
    `to`; return how many lines moved. `to` is flushed to disk before `path` is rewritten, so a crash in
    between leaves a row in both files, never in neither."""
    kept, dropped = split_after(path, step)
    if not dropped:
        return 0
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(to, "a", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in dropped))
        handle.flush()
        os.fsync(handle.fileno())
    rewrite_lines(path, kept)
    return len(dropped)


def split_after(path: Path, step: int) -> tuple[list[str], list[str]]:
    """The lines of `path` up to `step`, and the rest (from a line cut by a crash on, all of it)."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for index, line in enumerate(lines):
        try:
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step", 0), int) and row.get("step", 0) > step:
                return lines[:index], lines[index:]
        except json.JSONDecodeError:
            return lines[:index], lines[index:]
    return lines, []


def rewrite_lines(path: Path, lines: list[str]) -> None:
    """Replace `path` with `lines` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
