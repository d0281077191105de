"""What a run directory cannot make memtrain write: every path memtrain writes, truncates, moves or deletes
in a run stays inside it, and memtrain's own files there are read as input, not trusted.

Why: a run directory is often shared (a team's scratch disk, a job's output copied from elsewhere), and
memtrain writes into it as whoever resumes or exports the run. A symlink planted at the lock file made
its `O_CREAT | O_TRUNC` truncate the link's target; a `lineage.jsonl` record naming `../somewhere` as its
abandoned folder moved checkpoints out of the run (which then resumed from an older step, exit 0); a
symlinked staging directory or a `checkpoints/` symlink loop gave tracebacks, and with the loop a
trained step was lost. So:

- `check_run_paths` (rank 0, under the lock, before anything is written or cleaned): each of memtrain's
  own files and folders in the run is absent, or a regular file / a directory whose path, every symlink
  resolved, stays inside the run. Anything else is one `RunPathError` naming the path and what to do.
- `confined` resolves a path memtrain is about to write and refuses one that leaves its root.
- `remove_tree` deletes what memtrain created without following a symlink (a symlink is unlinked, its
  target untouched); `open_no_follow` opens a file memtrain owns with `O_NOFOLLOW`, regular files only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from memtrain import json_out
from memtrain.errors import MemtrainError
from memtrain.run.layout import RunLayout


class RunPathError(MemtrainError):
    """A path in a run directory that memtrain will not follow or write (it names the path and the fix)."""


def confined(root: Path, path: Path) -> Path:
    """`path` with every symlink resolved; `RunPathError` when that leaves `root` (itself resolved) or a
    symlink on the way leads nowhere (a loop, a missing target)."""
    base = Path(os.path.realpath(root))
    try:
        real = Path(os.path.realpath(path, strict=os.path.lexists(path)))
    except OSError as exc:  # a symlink loop (ELOOP) or a dangling link
        reason = "is a symlink loop" if exc.errno == errno.ELOOP else "is a symlink to nothing"
        raise RunPathError(f"{path}: {reason}; {_fix(path)}") from None
    if real != base and base not in real.parents:
        raise RunPathError(f"{path}: leads to {real}, outside the run directory {base}; {_fix(path)}")
    return real


def _fix(path: Path) -> str:
    return f"memtrain writes only inside the run directory: remove or move {path} (it is memtrain's own) and run again"


def check_run_paths(layout: RunLayout) -> None:
    """Every file and folder memtrain keeps in the run is absent, or a regular file / directory inside it."""
    for path in layout.own_files():
        if os.path.lexists(path) and not confined(layout.root, path).is_file():
            raise RunPathError(f"{path}: is not a regular file, and memtrain writes this file; {_fix(path)}")
    for path in layout.own_folders():
        if os.path.lexists(path) and not confined(layout.root, path).is_dir():
            raise RunPathError(f"{path}: is not a directory, and memtrain writes into it; {_fix(path)}")
    linked = sorted(p for p in layout.step_dirs() if p.is_symlink())
    if linked:
        raise RunPathError(
            f"{linked[0]}: is a symlink, and memtrain's checkpoints are directories it wrote there (one linked "
            f"elsewhere would be read on resume and pruned through); {_fix(linked[0])}"
        )


def unshare_own_files(layout: RunLayout) -> None:
    """Give each of memtrain's own files in the run (the lock aside: `lock.acquire` refuses a linked one)
    an inode of its own when it has other hard links: a `cp -al` copy of a run shares every file with the
    original, and a resume of the copy appended its metrics rows and lineage records to the original's
    files (a fresh run truncated a linked metrics.jsonl). The bytes are copied to a new file renamed over
    the name, so the other names keep theirs untouched."""
    for path in layout.own_files():
        if path != layout.lock_file:
            _unshare(path)


def _unshare(path: Path) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode) or info.st_nlink <= 1:
        return
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out, os.fdopen(open_no_follow(path, os.O_RDONLY), "rb") as source:
            shutil.copyfileobj(source, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise json_out.write_error(path, exc) from None


def remove_tree(path: Path) -> None:
    """Delete `path` if it exists: a directory with everything in it, a file or a symlink itself (never
    what a symlink points at; `shutil.rmtree` does not follow the links inside a tree)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def open_no_follow(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a file memtrain owns, refusing a symlink (`O_NOFOLLOW`) and anything but a regular
    file with a `RunPathError` naming it, before any byte of it is changed (`flags` must not truncate)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
            raise RunPathError(
                f"{path}: is not a regular file (a symlink or a directory); {_fix(path)}"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunPathError(f"{path}: is not a regular file; {_fix(path)}")
    return fd


def managed_folder_of(path: Path) -> Path | None:
    """The folder `path` (symlinks resolved) lies in, or is, that memtrain manages in a run directory
    (its checkpoints/ or abandoned/: a directory written there would be taken for a checkpoint or set
    aside), or None. A run directory is one that holds any of memtrain's own files."""
    real = Path(os.path.realpath(path))
    for candidate in (real, *real.parents):
        layout = RunLayout(candidate.parent)
        if candidate in layout.own_folders() and any(os.path.lexists(f) for f in layout.own_files()):
            return candidate
    return None
