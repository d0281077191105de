"""Tensor-file IO: the files a checkpoint is made of, written flushed to disk and read without pickle.

Why apart from the run: the sharding backends write and read their own tensor files inside a checkpoint
directory they are handed, and must not import the run's checkpoint lifecycle (staging, commit, pruning,
lineage: `memtrain.run`). This module is what both share: `save_tensor_file` / `write_file` (fsync'd),
`load_tensor_file` (`torch.load(weights_only=True)`: no arbitrary pickle from a checkpoint directory; a
file naming anything else is refused in one line, `load_weights_only`),
the RNG state in a weights_only-loadable form, and `CheckpointError`, the one-line error naming the file.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memtrain.errors import MemtrainError


class CheckpointError(MemtrainError):
    """A checkpoint that cannot be used; the message names the file."""


def write_file(path: Path, write: Callable[[Any], None]) -> None:
    """Write through `write(file)` and flush the bytes to disk."""
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())


def save_tensor_file(path: Path, obj: Any) -> None:
    write_file(path, lambda handle: torch.save(obj, handle))


def load_tensor_file(path: Path) -> Any:
    if path.is_symlink():  # memtrain writes regular files: a link may lead out of the run, or to a device
        raise CheckpointError(f"{path}: is a symlink, not a file memtrain wrote; remove this checkpoint")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    return load_weights_only(path, str(path), map_location="cpu")


def load_weights_only(handle: Any, what: str, map_location: Any = None, mmap: bool | None = None) -> Any:
    """`torch.load(weights_only=True)` of `handle`; a file that names anything else is one line naming `what`."""
    try:
        return torch.load(handle, map_location=map_location, mmap=mmap, weights_only=True)
    except Exception as exc:  # UnpicklingError for a forbidden global; several types for damaged bytes
        named = FORBIDDEN.search(str(exc))
        if named:
            raise CheckpointError(
                f"{what}: names {named.group(1)}, which no checkpoint file memtrain writes holds (not written by "
                "memtrain); nothing of it was run: remove this checkpoint or resume from another one"
            ) from None
        raise CheckpointError(f"{what}: cannot be loaded ({describe(exc)})") from None


FORBIDDEN = re.compile(r"Unsupported global: GLOBAL (\S+)")  # how torch's weights_only unpickler refuses


def describe(exc: BaseException) -> str:
    """`exc` in one line: its type and its first line (DCP and torch write several)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


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
