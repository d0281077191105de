"""The rows of a run's metrics.jsonl past a step: found, and moved aside whole.

Why here: a resume truncates the file to its step (the rows past it belong to a trajectory a rollback
abandoned, or to steps a killed run logged after its last checkpoint), and a truncation moves those rows
into the run's `abandoned/` folder next to the checkpoints it sets aside, so no row is ever lost. Both are
the run directory's business (`memtrain.run.lineage`); the jsonl logger only appends. The file is read as
bytes: a line that is not a UTF-8 JSON row (a crash's cut, or damage) and everything after it are moved
aside whole, never decoded into a traceback; neither write follows a symlink.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from memtrain import json_out
from memtrain.run.confine import open_no_follow


def abandon_rows_after(path: Path, step: int, to: Path) -> int:
    """Move the rows of `path` past `step` (and, from a line cut by a crash on, everything) to the end of
    `to`; return how many lines moved. `to` is flushed to disk before `path` is rewritten, so a crash in
    between leaves a row in both files, never in neither."""
    kept, dropped = split_after(path, step)
    if not dropped:
        return 0
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(open_no_follow(to, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "wb") as handle:
            handle.write(b"".join(line + b"\n" for line in dropped))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise json_out.write_error(to, exc) from None
    rewrite_lines(path, kept)
    return len(dropped)


def split_after(path: Path, step: int) -> tuple[list[bytes], list[bytes]]:
    """The lines of `path` up to `step`, and the rest (from a line cut by a crash, or any line that is not
    a UTF-8 JSON row, on: all of it, moved aside whole rather than read further)."""
    if not os.path.lexists(path):
        return [], []
    with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as handle:  # a regular file, never blocking
        lines = handle.read().splitlines()
    for index, line in enumerate(lines):
        try:
            row = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):
            return lines[:index], lines[index:]
        if isinstance(row, dict) and isinstance(row.get("step", 0), int) and row.get("step", 0) > step:
            return lines[:index], lines[index:]
    return lines, []


def rewrite_lines(path: Path, lines: list[bytes]) -> None:
    """Replace `path` with `lines` atomically (`json_out.write_bytes_atomic`)."""
    json_out.write_bytes_atomic(path, b"".join(line + b"\n" for line in lines))
