"""A rank stops when its launcher dies.

torchrun starts every rank in a session of its own, so a SIGKILL to torchrun alone (the OOM killer, a
`kill -9` of the wrong pid, a scheduler that kills only the step's launcher) leaves the ranks training
with nobody to collect their exit codes or restart them, holding their GPUs until the run ends.

Under a launcher (TORCHELASTIC_RUN_ID or LOCAL_RANK set) a daemon thread polls the parent pid. When the
launcher is gone the rank sends itself SIGTERM: inside the loop that is the preemption path (the step
in flight finishes, the ranks agree, a checkpoint, a normal end; every rank sees the same launcher die,
so they stop together), before the loop it ends the process. A rank still alive GRACE_S later, e.g.
blocked in a collective with a peer that died too, exits hard.

Why polling and not prctl(PR_SET_PDEATHSIG): the kernel sends that signal when the *thread* that
started the process exits, not the process, so a launcher that starts ranks from a worker thread would
stop them for nothing; it is Linux only; and the hard exit after the grace period needs a thread anyway.
The parent is recorded when memtrain is imported: a launcher that dies before that is not noticed.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time

POLL_S = 0.5
GRACE_S = 30.0  # what torchrun itself leaves a rank between its SIGTERM and its SIGKILL
EXIT_ORPHANED = 128 + signal.SIGTERM  # 143: as if the SIGTERM had ended the process
PARENT_AT_START = os.getppid()


def under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


@functools.cache
def watch_launcher() -> None:
    """Start the watchdog (once per process)."""
    threading.Thread(
        target=_watch, args=(PARENT_AT_START,), name="memtrain-launcher-watchdog", daemon=True
    ).start()


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    _say(f"the launcher (pid {launcher}) is gone; stopping this rank")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    _say(f"still running {GRACE_S:.0f} s after the launcher died; exiting without a checkpoint")
    os._exit(EXIT_ORPHANED)


def _say(message: str) -> None:
    print(f"memtrain (rank {os.environ.get('RANK', '?')}): {message}", file=sys.stderr, flush=True)
