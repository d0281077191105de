"""Per-step metrics: a JSONL file in the run directory, a progress bar, and the end-of-run summary.

Only rank 0 writes. The JSONL survives a crash line by line; on resume, rows past the resumed step are
dropped so the file reads as one uninterrupted run.
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
        kept = []
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line)
                except json.JSONDecodeError:
                    break  # a line cut by a crash ends the readable part
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, row: dict[str, Any]) -> None:
        self._handle.write(json_out.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def make_progress(setting: str, total: int, initial: int, enabled: bool) -> tqdm | None:
    """A tqdm bar on rank 0: `on`, `off`, or `auto` (only when stderr is a terminal)."""
    show = enabled and (setting == "on" or (setting == "auto" and sys.stderr.isatty()))
    if not show:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
