"""Strict JSON for every file and report memtrain writes.

Why: Python's `json` writes NaN and Infinity by default, which is not JSON: `jq`, JavaScript, pandas'
strict readers and most dashboards reject the whole file. A non-finite number (a diverged loss, an
evaluation with no tokens) is written as `null`, and the dotted paths of the values replaced are listed
under the key `nonfinite` of the top-level object, so nothing is silently lost.

Files are written atomically through a temporary file of their own (`write_atomic`), and a failure to
write (a full disk above all) is one line naming the file, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from memtrain.errors import MemtrainError

NONFINITE_KEY = "nonfinite"
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # what a full disk or an exhausted quota raise


def finite_only(value: Any, path: str = "", replaced: list[str] | None = None) -> Any:
    """`value` with every NaN/inf float replaced by None; the dotted path of each goes to `replaced`."""
    if isinstance(value, float) and not math.isfinite(value):
        if replaced is not None:
            replaced.append(f"{path or '.'}={value}")
        return None
    if isinstance(value, dict):
        return {k: finite_only(v, f"{path}.{k}" if path else str(k), replaced) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(v, f"{path}[{i}]", replaced) for i, v in enumerate(value)]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps` that never writes NaN/Infinity (see the module docstring)."""
    replaced: list[str] = []
    clean = finite_only(value, "", replaced)
    if replaced and isinstance(clean, dict):
        clean[NONFINITE_KEY] = replaced
    return json.dumps(clean, allow_nan=False, **options)


def write_atomic(path: Path, data: Any) -> None:
    """Write `data` as indented, sorted strict JSON to `path` through a temporary file and a rename, so a
    reader never sees half a file. The temporary file is a new one with a name of its own (`mkstemp`:
    exclusive, never a symlink planted at a guessable name), flushed to disk before the rename; a failure
    removes it and is a one-line `MemtrainError` naming `path` (`write_error`)."""
    write_bytes_atomic(path, dumps(data, indent=2, sort_keys=True).encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (`replace_atomic`)."""
    replace_atomic(path, lambda out: out.write(data))


def replace_atomic(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Replace `path` with what `fill` writes, atomically: through a new temporary file of its own next to it
    (never a name a symlink could be planted at), fsync'd, renamed over it; an `OSError` removes it and is
    `write_error`'s line."""
    tmp: str | None = None
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(handle, "wb") as out:
            fill(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise write_error(path, exc) from None


def write_error(path: Path, exc: OSError) -> MemtrainError:
    """The one-line error for a file memtrain could not write: a full disk (or quota) says so, like a
    checkpoint's; anything else names the file and the reason. The file's previous version is intact."""
    if exc.errno in DISK_FULL:
        return MemtrainError(
            f"no space left on the device (or disk quota exceeded) writing {path}; its previous version is "
            "intact. Free disk space, or copy the run directory to a disk with room and set run.output_dir "
            "to it, then run again (a training run continues with --resume)"
        )
    return MemtrainError(
        f"{path}: cannot be written ({exc.strerror or exc}); make it a writable file (memtrain's own: "
        "move away whatever is in its place) and run again"
    )
