"""The rows of a run's metrics.jsonl past a step: found, and moved aside whole.

Why here: a resume truncates the file to its step (the rows past it belong to a trajectory a rollback
abandoned, or to steps a killed run logged after its last checkpoint), and a truncation moves those rows
into the run's `abandoned/` folder next to the checkpoints it sets aside, so no row is ever lost. Both are
the run directory's business (`memtrain.run.lineage`); the jsonl logger only appends. The file is read as
bytes, line by line (a long run's file may be larger than memory; a line longer than `MAX_ROW_BYTES` is
not one memtrain wrote): a line that is not a UTF-8 JSON row (a crash's cut, or damage) and everything
after it are moved aside whole, never decoded into a traceback; neither file is followed through a
symlink, and the kept rows are written to a new file renamed over the old one (never truncated in place).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import BinaryIO

from memtrain import json_out
from memtrain.run.confine import open_no_follow

MAX_ROW_BYTES = 16 * 2**20  # one metrics row is a few hundred bytes
CHUNK_BYTES = 2**20


def abandon_rows_after(path: Path, step: int, to: Path) -> int:
    """Move the rows of `path` past `step` (and, from a line cut by a crash on, everything) to the end of
    `to`; return how many lines moved. `to` is flushed to disk before `path` is rewritten, so a crash in
    between leaves a row in both files, never in neither."""
    if not os.path.lexists(path):
        return 0
    with os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as source:  # a regular file, never blocking
        cut = split_offset(source, step)
        if cut is None:
            return 0
        source.seek(cut)
        moved = _append_rest(source, to)
        source.seek(0)
        _replace_with_prefix(source, cut, path)
    return moved


def split_offset(handle: BinaryIO, step: int) -> int | None:
    """The byte offset of the first line of `handle` to move aside: a row past `step`, or a line that is
    not a UTF-8 JSON row (or is longer than any row memtrain writes); None when every line stays."""
    offset = 0
    while line := handle.readline(MAX_ROW_BYTES + 1):
        if len(line) > MAX_ROW_BYTES:
            return offset
        try:
            row = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):
            return offset
        if isinstance(row, dict) and isinstance(row.get("step", 0), int) and row.get("step", 0) > step:
            return offset
        offset += len(line)
    return None


def _append_rest(source: BinaryIO, to: Path) -> int:
    """Append what is left of `source` to `to` (ending in a newline), flushed to disk; the lines moved."""
    lines, last = 0, b"\n"
    try:
        to.parent.mkdir(parents=True, exist_ok=True)
        with os.fdopen(open_no_follow(to, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "wb") as handle:
            while chunk := source.read(CHUNK_BYTES):
                handle.write(chunk)
                lines, last = lines + chunk.count(b"\n"), chunk[-1:]
            if last != b"\n":
                handle.write(b"\n")
                lines += 1
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        raise json_out.write_error(to, exc) from None
    return lines


def _replace_with_prefix(source: BinaryIO, size: int, path: Path) -> None:
    """Replace `path` with the first `size` bytes of `source`, atomically (`json_out.replace_atomic`)."""
    json_out.replace_atomic(path, lambda out: shutil.copyfileobj(_Prefix(source, size), out, CHUNK_BYTES))


class _Prefix:
    """The first `size` bytes of `source`, read in chunks (for `shutil.copyfileobj`)."""

    def __init__(self, source: BinaryIO, size: int) -> None:
        self.source, self.left = source, size

    def read(self, count: int = -1) -> bytes:
        count = self.left if count < 0 else min(count, self.left)
        data = self.source.read(count)
        self.left -= len(data)
        return data
