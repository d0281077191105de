"""Per-step metrics: a JSONL file in the run directory, a progress bar, and the end-of-run summary.

Only rank 0 writes. The JSONL survives a crash line by line; on resume, rows past the resumed step are
moved to an abandoned file (`abandon_rows_after`, called by `fit`: they belong to a trajectory a rollback
abandoned, or to steps a killed run logged after its last checkpoint) so the file reads as one
uninterrupted run and no row is lost. `MetricsLog` drops any such rows still there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from memtrain import json_out


class MetricsLog:
    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            path.write_text("")
        else:
            self._truncate_after(resume_step)
        self._handle: TextIO = open(path, "a", encoding="utf-8")

    def _truncate_after(self, step: int) -> None:
        _rewrite(self.path, _split_after(self.path, step)[0])

    def write(self, row: dict[str, Any]) -> None:
        self._handle.write(json_out.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def abandon_rows_after(path: Path, step: int, to: Path) -> int:
    """Move the rows of `path` past `step` (and, from a line cut by a crash on, everything) to the end of
    `to`; return how many lines moved. `to` is flushed to disk before `path` is rewritten, so a crash in
    between leaves a row in both files, never in neither."""
    kept, dropped = _split_after(path, step)
    if not dropped:
        return 0
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(to, "a", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in dropped))
        handle.flush()
        os.fsync(handle.fileno())
    _rewrite(path, kept)
    return len(dropped)


def _split_after(path: Path, step: int) -> tuple[list[str], list[str]]:
    """The lines of `path` up to `step`, and the rest (from a line cut by a crash on, all of it)."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for index, line in enumerate(lines):
        try:
            if json.loads(line).get("step", 0) > step:
                return lines[:index], lines[index:]
        except json.JSONDecodeError:
            return lines[:index], lines[index:]
    return lines, []


def _rewrite(path: Path, lines: list[str]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def make_progress(setting: str, total: int, initial: int, enabled: bool) -> tqdm | None:
    """A tqdm bar on rank 0: `on`, `off`, or `auto` (only when stderr is a terminal)."""
    show = enabled and (setting == "on" or (setting == "auto" and sys.stderr.isatty()))
    if not show:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
