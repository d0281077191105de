"""Stopping on a signal: SIGTERM (what SLURM, Kubernetes and torchrun send before killing a job) and
SIGINT (Ctrl-C, which torchrun forwards to its ranks) ask the run to stop. The step in flight
finishes, every rank agrees, a checkpoint is written, and the process exits: 0 after SIGTERM (a
preemption is a normal end), 130 after SIGINT (the shell's code for "interrupted"). `--resume` then
continues exactly where the run stopped.

A second Ctrl-C means "now": the process exits 130 at once, without waiting for the step or the
checkpoint. That corrupts nothing, because checkpoints are renamed into place only once complete; a
checkpoint cut short stays a staging directory, which resume ignores.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

HANDLED = (signal.SIGTERM, signal.SIGINT)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: what a shell reports for a process ended by Ctrl-C


class PreemptionFlag:
    """Context manager that turns SIGTERM and SIGINT into a flag the loop checks between steps."""

    def __init__(self) -> None:
        self.signal_name: str | None = None  # "SIGTERM" or "SIGINT" (Ctrl-C outranks SIGTERM)
        self._previous: dict[signal.Signals, object] = {}

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.signal_name == "SIGINT":
            _exit_now()
        if self.signal_name != "SIGINT":
            self.signal_name = name

    def __enter__(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():  # None: a handler not set from Python
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # type: ignore[arg-type]
        self._previous = {}


def _exit_now() -> None:
    """The second Ctrl-C: leave without the step in flight or the checkpoint, and without any cleanup
    that could wait on other ranks. os.write: a signal handler may run inside a buffered print."""
    rank = os.environ.get("RANK")
    who = f"memtrain (rank {rank})" if rank not in (None, "0") else "memtrain"
    os.write(2, f"{who}: interrupted again; exiting now, without a checkpoint of this step\n".encode())
    os._exit(EXIT_INTERRUPTED)
