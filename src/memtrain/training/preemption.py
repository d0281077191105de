"""Preemption: SIGTERM (what SLURM, Kubernetes and torchrun send before killing a job) asks the run to
stop. The step in flight finishes, every rank agrees, a checkpoint is written, and the process exits 0.
`--resume` then continues exactly where the run stopped.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class PreemptionFlag:
    """Context manager that turns SIGTERM into a flag the loop checks between steps."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: object = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.raised = True

    def __enter__(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None
