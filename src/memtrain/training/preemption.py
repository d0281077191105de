"""Stopping on a signal. The stop signals (`train.stop_signals`; by default SIGTERM, what SLURM,
Kubernetes and torchrun send before killing a job, SIGHUP, a closed terminal or ssh session, SIGUSR1,
SLURM's pre-emption warning with `--signal`, and SIGQUIT) and SIGINT (Ctrl-C, which torchrun forwards to
its ranks, always handled) ask the run to stop. The step in flight finishes, every rank agrees, a
checkpoint is written, and the process exits: 0 after a stop signal (a pre-emption is a normal end),
130 after SIGINT (the shell's code for "interrupted"). `--resume` then continues exactly where the run
stopped. SIGQUIT, handled, dumps no core.

The handlers are installed before planning (`watching`), and they only set a flag: an interrupt raised
inside the planner's traces or torch's C++ code could be swallowed by a fallback (the run trained to the
end and exited 0) or abort the process (SIGABRT). A signal before step 1 stops the run at the next safe
point instead: between the planner's traces (one process), at the end of `setup()` and before the
first step (every rank agrees). Nothing is trained yet, so nothing is lost: Ctrl-C raises
`KeyboardInterrupt` (exit 130, one line), a stop signal raises `SignalStop` (exit 0, one line).

A second Ctrl-C means "now": the process exits 130 at once, without waiting for the step, the planner
or the checkpoint. That corrupts nothing, because checkpoints are renamed into place only once complete;
a checkpoint cut short stays a staging directory, which resume ignores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module before torch, whose import it guards
    from memtrain.distributed import DistEnv

INTERRUPT = "SIGINT"  # Ctrl-C: always handled, outranks every stop signal
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: what a shell reports for a process ended by Ctrl-C
EXIT_STOPPED_BY_SIGNAL = 0  # a stop signal (a pre-emption) after its checkpoint: a normal end


class SignalStop(BaseException):
    """A stop signal arrived before step 1: the run stopped with nothing trained (exit 0 from the command
    line). A BaseException, like KeyboardInterrupt: no `except Exception` fallback may swallow it."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(
            f"{signal_name}: stopped with no step in flight, nothing trained is lost; continue with --resume auto"
        )
        self.signal_name = signal_name


class PreemptionFlag:
    """Context manager that turns SIGINT and the stop signals into a flag checked at safe points."""

    def __init__(self, stop_signals: Sequence[str]) -> None:
        mine = (s for s in stop_signals if s != INTERRUPT and hasattr(signal, s))  # SIGPWR: Linux only
        self.handled_signals = (INTERRUPT, *dict.fromkeys(mine))
        self.signal_name: str | None = None  # the first signal, but Ctrl-C outranks the others
        self.settled = False  # a stop was agreed on and acted upon
        self._previous: dict[signal.Signals, object] = {}

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if name == INTERRUPT and self.signal_name == INTERRUPT:
            _exit_now()
        if name == INTERRUPT or self.signal_name is None:
            self.signal_name = name

    def __enter__(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            sigs = [signal.Signals[name] for name in self.handled_signals]
            self._previous = {sig: signal.signal(sig, self._handle) for sig in sigs}
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():  # None: a handler not set from Python
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)  # type: ignore[arg-type]
        self._previous = {}

    def stop_now(self) -> None:
        """Raise what stops a run before step 1, if a signal arrived (on this process only)."""
        if self.raised:
            self.settled = True
            raise KeyboardInterrupt if self.signal_name == INTERRUPT else SignalStop(str(self.signal_name))


_active: list[PreemptionFlag] = []  # the flag installed by the outermost `watching`


@contextlib.contextmanager
def watching(stop_signals: Sequence[str]) -> Iterator[PreemptionFlag]:
    """The installed flag, installing one for `stop_signals` unless a caller already did (the command
    line watches from before the trainer is built; `setup()` and `fit()` also alone). A signal that
    arrived but was not acted upon when the outermost block ends raises there: none is ever swallowed."""
    if _active:
        yield _active[0]
        return
    with PreemptionFlag(stop_signals) as flag:
        _active.append(flag)
        try:
            yield flag
        finally:
            _active.clear()
    if not flag.settled:
        flag.stop_now()


def interruptible(progress: Callable[[str], None], env: DistEnv) -> Callable[[str], None]:
    """`progress` for the planner that first stops a one-process run on a pending signal: its lines come
    between traces, in plain Python. Several ranks stop together at the end of `setup()` instead."""

    def checked(line: str) -> None:
        if _active and not env.distributed:
            _active[0].stop_now()
        progress(line)

    return checked


def agreed_signal(flag: PreemptionFlag, env: DistEnv) -> str | None:
    """The signal every rank stops for, or None (a collective on several ranks: every rank calls it at
    the same point). SIGINT on any rank outranks the others; then the first of the stop signals."""
    import torch

    from memtrain.distributed import all_reduce_sum

    order = flag.handled_signals
    mine = torch.zeros(len(order), dtype=torch.long, device=env.device)
    if flag.signal_name is not None and not flag.settled:  # a stop acted upon is not counted again
        mine[order.index(flag.signal_name)] = 1
    counts = all_reduce_sum(mine, env).tolist()
    name = next((s for s, n in zip(order, counts, strict=True) if n > 0), None)
    if name is not None:
        flag.signal_name, flag.settled = name, True
    return name


def stop_before_training(flag: PreemptionFlag, env: DistEnv) -> None:
    """Every rank raises (KeyboardInterrupt or SignalStop) when a signal reached one before step 1."""
    if agreed_signal(flag, env) is not None:
        flag.stop_now()


def announce(signal_name: str, step: int, env: DistEnv) -> None:
    """The line that says the run stopped after `step` with a checkpoint (rank 0's)."""
    if env.is_main:
        print(
            f"[memtrain] {signal_name}: stopped after step {step} with a checkpoint; continue with --resume",
            flush=True,
        )


def _exit_now() -> None:
    """The second Ctrl-C: leave without the step in flight or the checkpoint, and without any cleanup
    that could wait on other ranks. os.write: a signal handler may run inside a buffered print."""
    rank = os.environ.get("RANK")
    who = f"memtrain (rank {rank})" if rank not in (None, "0") else "memtrain"
    os.write(2, f"{who}: interrupted again; exiting now, without a checkpoint of this step\n".encode())
    os._exit(EXIT_INTERRUPTED)
