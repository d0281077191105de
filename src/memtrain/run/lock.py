"""One writer per run directory: an advisory lock on `<run>/.memtrain.lock`.

Why: two `memtrain train` processes on one run.output_dir (two jobs started together, or a job restarted
while the old one still runs) write the same checkpoints and metrics.jsonl: one dies mid-rename with a
`FileExistsError` traceback, metrics.jsonl holds steps twice, and two `--resume auto` runs both proceed.
So rank 0 takes `fcntl.flock(LOCK_EX | LOCK_NB)` on the lock file at the start of `Trainer.fit`
(`RunDirectory.locked`), before
anything in the run directory is written, truncated or cleaned, and holds it until `fit` returns or the
process ends. A second writer gets a one-line `RunDirInUse` (exit 2) naming the holder. The lock file is
opened with `O_NOFOLLOW` and must be a regular file: a symlink planted there (whose target the truncation
would empty) or a directory is a one-line `RunPathError`, and nothing is written.

The lock belongs to the open file, not to the file's existence: the kernel drops it when the holder's
process ends, however it ends (SIGKILL included). A lock file left by a dead process is therefore simply
taken over; the file is never deleted (deleting it would let two processes lock two different files).
One that other hard links share (a run copied with `cp -al`: the original's lock file) is replaced by a
new one, locked before it is renamed into place, and the shared one stays locked until release, so a
process that opened it first still finds the run in use.
Its content is information only: the holder (pid, host, start time, command line) as JSON, written after
locking and emptied on release.

Limits: the lock is advisory (it stops other memtrain processes, not `rm` or other tools). It is as
good as the filesystem's locking: on local filesystems and NFSv4 (or NFSv3 with lockd), Linux maps flock
to a lock the server sees from every client; on filesystems without working network locks (some FUSE
and old NFS setups) it only excludes processes on the same host, so give concurrent jobs on several
hosts distinct run directories there.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtrain import json_out
from memtrain.errors import MemtrainError
from memtrain.run.confine import RunPathError, open_no_follow
from memtrain.run.layout import RunLayout

COMMAND_CHARS = 160  # the holder's command line, cut to this in the error
HOLDER_WAIT_S = 2.0  # how long a refused writer waits for the holder to record itself
HOLDER_BYTES = 64 * 1024  # the most of the lock file read for the holder (it is a few hundred bytes)


class RunDirInUse(MemtrainError):
    """Another process holds the run directory's lock."""


@dataclass
class RunLock:
    """The held lock; `release` (or the end of the process) frees it."""

    path: Path
    fd: int
    shared: int | None = None  # a hard-linked lock file replaced by `fd`'s, locked too until release

    def release(self) -> None:
        os.ftruncate(self.fd, 0)  # no stale holder is shown to the next one that waits for this
        os.close(self.fd)  # closing the only descriptor of the open file drops the flock
        if self.shared is not None:
            os.close(self.shared)


def acquire(run_dir: Path) -> RunLock:
    """Lock `run_dir` (created if needed) for this process; `RunDirInUse` when another process holds it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file, or a symlink to nothing (a loop, a missing target)
        raise RunPathError(
            f"run.output_dir: {run_dir} exists and is not a directory (a file, or a symlink to nothing); "
            "set run.output_dir to a directory"
        ) from None
    path = RunLayout(run_dir).lock_file
    fd = open_no_follow(path, os.O_RDWR | os.O_CREAT)  # a symlink planted here is refused, not followed
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise in_use_error(run_dir) from None
    except BaseException:
        os.close(fd)
        raise
    if os.fstat(fd).st_nlink > 1:  # a `cp -al` copy of a run: the original's lock file too
        return RunLock(path, _own_lock_file(path), shared=fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json_out.dumps(_holder()).encode(), 0)
    return RunLock(path, fd)


def _own_lock_file(path: Path) -> int:
    """A lock file of this run's own, locked, renamed over one that other hard links share (writing the
    holder into it wrote the original run's). The shared one stays locked until `release`: a process that
    opened it before the rename must still find the run in use."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=".tmp", dir=path.parent)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else holds it
    os.fchmod(fd, 0o644)
    os.pwrite(fd, json_out.dumps(_holder()).encode(), 0)
    os.replace(tmp, path)
    return fd


def in_use_error(run_dir: Path) -> RunDirInUse:
    """The error for a run directory someone else holds, naming the holder when it has recorded itself."""
    holder = _wait_for_holder(RunLayout(run_dir).lock_file)
    advice = "wait for it to finish or set run.output_dir to another directory"
    if holder is None:
        return RunDirInUse(f"run.output_dir {run_dir} is in use by another memtrain process; {advice}")
    command = str(holder.get("command", "?"))
    if len(command) > COMMAND_CHARS:
        command = command[: COMMAND_CHARS - 3] + "..."
    return RunDirInUse(
        f"run.output_dir {run_dir} is in use by pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')} since {holder.get('since', '?')} (started with {command}); {advice}"
    )


def _wait_for_holder(path: Path) -> dict[str, Any] | None:
    """The holder, given a moment to record itself: it writes just after it locks, and a second writer
    started at the same instant can find the lock taken but the file still empty."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while (holder := read_holder(path)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return holder


def read_holder(path: Path) -> dict[str, Any] | None:
    """The holder recorded in a lock file, or None (empty: released, or the holder is still writing)."""
    try:
        fd = open_no_follow(path, os.O_RDONLY)
    except (OSError, RunPathError):
        return None
    try:
        holder = json.loads(os.read(fd, HOLDER_BYTES).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return holder if isinstance(holder, dict) else None


def _holder() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
    }
