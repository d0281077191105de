"""Atomic, resumable checkpoints.

Layout: `<run>/checkpoints/step_00000010/` holding `model.pt`, `optimizer.pt`, `rng_rank<r>.pt` and
`meta.json`. Every file is written into `step_00000010.tmp/` first, flushed to disk, and the directory
is renamed into place only when complete: a crash mid-save leaves a `.tmp` directory that is never
picked up (and is removed by the next save), and the previous checkpoint stays intact. Only the last
`keep` checkpoints are kept; an old one is renamed to `.tmp` before it is deleted, so a crash mid-prune
never leaves a half-deleted checkpoint that looks complete. A `step_*` directory is therefore always
whole unless something outside memtrain damaged it, so one with a damaged or missing meta.json is still
listed, and fails with an error naming the file (or is skipped by `checkpoint.fallback`).

Loading uses `torch.load(weights_only=True)`: no arbitrary pickle from a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memtrain import json_out
from memtrain.errors import MemtrainError

STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(MemtrainError):
    """A checkpoint that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int

    @property
    def meta(self) -> dict[str, Any]:
        """meta.json, read and checked when asked for (a damaged one must not hide the others)."""
        return read_meta(self.path, self.step)


# meta.json fields memtrain reads on resume, and their JSON types.
META_TYPES: dict[str, type] = {
    "step": int,
    "world_size": int,
    "plan": dict,
    "skipped_steps": int,
    "model_section": dict,
}


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Checkpoint directories under `root`, oldest first (`.tmp` directories are not checkpoints)."""
    if not root.is_dir():
        return []
    found = [
        Checkpoint(child, int(match.group(1)))
        for child in root.iterdir()
        if (match := STEP_DIR.match(child.name)) and child.is_dir()
    ]
    return sorted(found, key=lambda c: c.step)


def read_meta(path: Path, step: int | None = None) -> dict[str, Any]:
    """The checkpoint's meta.json; CheckpointError naming the file when it is missing or damaged."""
    file = path / "meta.json"
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # missing, unreadable, not UTF-8, not JSON
        raise CheckpointError(f"{file}: unreadable checkpoint metadata ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: checkpoint metadata must be a JSON object, not {type(meta).__name__}")
    wrong = [
        f"{key} is not {kind.__name__}"
        for key, kind in META_TYPES.items()
        if key in meta and not isinstance(meta[key], kind)
    ]
    if wrong:
        raise CheckpointError(f"{file}: damaged checkpoint metadata ({'; '.join(wrong)})")
    if step is not None and meta.get("step", step) != step:
        raise CheckpointError(f"{file}: says step {meta['step']}, but its directory is step {step}")
    return meta


def find_checkpoint(location: Path) -> Checkpoint:
    """`location` is one checkpoint directory or a directory of them (the newest is taken)."""
    match = STEP_DIR.match(location.name)
    if match and location.is_dir():
        return Checkpoint(location, int(match.group(1)))
    found = list_checkpoints(location)
    if not found:
        raise CheckpointError(
            f"no checkpoint under {location}; train without --resume or point --resume at one"
        )
    return found[-1]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, write: Callable[[Any], None]) -> None:
    """Write through `write(file)` and flush the bytes to disk."""
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def save_tensor_file(path: Path, obj: Any) -> None:
    write_file(path, lambda handle: torch.save(obj, handle))


def load_tensor_file(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path}: cannot be loaded ({type(exc).__name__}: {exc})") from None


def staging_dir(root: Path, step: int) -> Path:
    return root / f"{step_dir_name(step)}.tmp"


def begin_save(root: Path, step: int) -> Path:
    """Create an empty staging directory for `step` (called on rank 0 before the others write)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = staging_dir(root, step)
    staging.mkdir()
    return staging


def commit_save(root: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
    """Write meta.json last, rename the staging directory into place, then prune old checkpoints."""
    staging = staging_dir(root, step)
    write_file(
        staging / "meta.json", lambda h: h.write(json_out.dumps(meta, indent=2, sort_keys=True).encode())
    )
    _fsync_dir(staging)
    final = root / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep]:
        doomed = old.path.with_name(old.path.name + ".tmp")  # out of the listing in one rename
        os.replace(old.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def load_rng_state(path: Path) -> None:
    """Restore the random streams saved in `path` (see `rng_state`)."""
    state = load_tensor_file(path)
    try:
        set_rng_state(state)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(
            f"{path}: not an RNG state saved by memtrain ({type(exc).__name__}: {exc})"
        ) from None


def rng_state() -> dict[str, Any]:
    """Every random stream the loop may draw from, in a weights_only-loadable form."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [
            np_kind,
            torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    kind, keys, pos, has_gauss, np_gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, np_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
