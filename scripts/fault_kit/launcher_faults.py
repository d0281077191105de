"""Fault scenarios for the signals a person sends and for a launcher that dies: rows of
`scripts/fault_suite.py`, beside `scenarios.sigterm`, whose checks they share.

- `ctrl_c`: SIGINT (Ctrl-C) to a running `memtrain train` while a step runs. The run must stop after
  the step in flight with a checkpoint, say so, exit 130 without a traceback, and `--resume auto` must
  continue bit-identically. Every other trial sends a second Ctrl-C shortly after the first (mid-step,
  mid-checkpoint or after): the process may then leave at once, but still exits 130 without a
  traceback, every checkpoint on disk stays whole, and the resume is still bit-identical.
- `signal_matrix`: SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGQUIT, each at drawn moments: before planning,
  during it, mid-step (in a forward), during a checkpoint write. The documented exit code (130 for
  SIGINT, 0 for the others), no traceback and no core file, the step in flight checkpointed (a signal
  before step 1: one line, nothing trained, nothing written to resume from), and `--resume auto` bit-
  identical to an uninterrupted run. The signal comes from the process itself at the moment (the fault
  kit's `signal` fault), so the moment is exact without sleeping; `in_process` runs the command lines in
  this process (the CI test), else each is a process of its own (the suite's row).
- `launcher_death`: SIGKILL to the torchrun launcher alone, not to its ranks (which run in sessions of
  their own), mid-run. Every rank must exit within LAUNCHER_DEATH_LIMIT_S instead of training on with
  nobody to supervise it; the figure is how long the last rank took.

Both need real processes (signals, a launcher), so they launch `fault_kit.faults` like the SIGTERM row,
with steps slowed so that a signal lands mid-step. Process lookups read Linux's /proc.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import torch

from memtrain import cli
from memtrain.run import checkpoints as ckpt

from fault_kit import faults
from fault_kit.faults import Fault, Harness
from fault_kit.scenarios import (
    DDP_ENV,
    SIGTERM_SECTIONS,
    Launch,
    Outcome,
    _wait_for_rows,
    audit_checkpoints,
    final_state,
    finish,
    in_process,
    launch,
    recipe_dict,
    run_difference,
    start,
    timed,
    train_cmd,
    write_recipe,
)

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for Ctrl-C: the contract checked
SLOW_STEPS = Harness((Fault("delay", rank=-1, seconds=0.15),))  # a signal then lands mid-step
LAUNCHER_DEATH_LIMIT_S = 30.0  # torchrun's own grace period between SIGTERM and SIGKILL


# ---------------------------------------------------------------------------------------------- Ctrl-C


def ctrl_c(work: Path, trials: int, seed: int) -> Outcome:
    """Ctrl-C (once, or twice in odd-numbered trials) to `memtrain train` at a random step, then
    `--resume auto`: exit 130, no traceback, whole checkpoints, a bit-identical resume."""
    outcome = Outcome("Ctrl-C", "SIGINT while a step runs (every other trial twice), then --resume auto")
    with timed(outcome):
        recipe = write_recipe(
            work / "ctrl_c.yaml", recipe_dict(work / "ctrl_c-reference", **SIGTERM_SECTIONS)
        )
        reference = launch(train_cmd(recipe))
        if reference.rc != 0:
            outcome.record(f"the uninterrupted run failed:\n{reference.tail()}", "reference")
            return outcome
        template = final_state(work / "ctrl_c-reference")["model"]
        rng = random.Random(f"{seed}-ctrl_c")
        for index in range(trials):
            run = work / f"ctrl_c-{index}"
            target = rng.randint(2, 9)
            second = rng.uniform(0.0, 0.2) if index % 2 else None  # seconds after the first Ctrl-C
            started = time.perf_counter()
            proc = start(train_cmd(recipe, f"run.output_dir={run}", harness=SLOW_STEPS))
            seen = _wait_for_rows(run / "metrics.jsonl", target, proc, timeout=120)
            proc.send_signal(signal.SIGINT)
            if second is not None:
                time.sleep(second)
                proc.send_signal(signal.SIGINT)
            stopped = finish(proc, started)
            if second is None:
                problem = _check_interrupted(run, stopped, seen)
            else:
                problem = _check_interrupted_twice(run, stopped, template)
                outcome.count("twice")
            if problem is None:
                resumed = launch(train_cmd(recipe, f"run.output_dir={run}", resume=True))
                problem = (
                    run_difference(run, work / "ctrl_c-reference")
                    if resumed.rc == 0
                    else f"the resume failed (exit {resumed.rc}):\n{resumed.tail()}"
                )
            twice = "" if second is None else f", again {second:.2f} s later"
            outcome.record(problem, f"trial {index}: Ctrl-C after {seen} logged steps{twice}")
        outcome.figures["bit-exact resumes"] = outcome.passed
    return outcome


def _check_interrupted(run: Path, stopped: Launch, seen: int) -> str | None:
    if stopped.rc != EXIT_INTERRUPTED or "Traceback" in stopped.output:
        return f"expected exit {EXIT_INTERRUPTED} without a traceback, got {stopped.rc}:\n{stopped.tail()}"
    found = re.search(r"SIGINT: stopped after step (\d+) with a checkpoint", stopped.output)
    if found is None:
        return f"no message naming SIGINT and the step:\n{stopped.tail()}"
    step = int(found.group(1))
    if step - seen not in (0, 1):
        return f"stopped after step {step}, but {seen} steps were logged at Ctrl-C"
    newest = ckpt.find_checkpoint(run / "checkpoints")
    return None if newest.step == step else f"the newest checkpoint is step {newest.step}, expected {step}"


def _check_interrupted_twice(run: Path, stopped: Launch, template: dict[str, torch.Tensor]) -> str | None:
    if stopped.rc != EXIT_INTERRUPTED or "Traceback" in stopped.output:
        return f"expected exit {EXIT_INTERRUPTED} without a traceback, got {stopped.rc}:\n{stopped.tail()}"
    return audit_checkpoints(run / "checkpoints", template)


# ---------------------------------------------------------------------------------------------- signal matrix

MATRIX_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGQUIT")
MOMENTS = ("plan", "planning", "forward", "save")  # before planning, during it, mid-step, mid-checkpoint
MATRIX_STEPS, MATRIX_EVERY = 6, 2
MATRIX_SECTIONS: dict[str, dict[str, object]] = {
    "train": {"steps": MATRIX_STEPS, "warmup_steps": 2, "lr": 1e-2},
    "checkpoint": {"every": MATRIX_EVERY, "keep": 3, "at_end": True},
    "strategies": {"checkpointing": "auto"},  # a choice left open: the planner traces (the planning moment)
}


def signal_matrix(
    work: Path, trials: int, seed: int, in_process: bool = False, signals: tuple[str, ...] = MATRIX_SIGNALS
) -> Outcome:
    """`trials` signals, the `signals` in turn, at moments that cycle through the four (shifted by the seed)
    with drawn steps and files; each stopped run is resumed and compared with an uninterrupted one."""
    outcome = Outcome(
        "signal matrix", "SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGQUIT at drawn moments, then --resume auto"
    )
    with timed(outcome):
        recipe = write_recipe(work / "matrix.yaml", recipe_dict(work / "matrix-reference", **MATRIX_SECTIONS))
        reference = _matrix_run(train_cmd(recipe), in_process)
        if reference.rc != 0:
            outcome.record(f"the uninterrupted run failed:\n{reference.tail()}", "reference")
            return outcome
        rng = random.Random(f"{seed}-signal-matrix")
        for index in range(trials):
            sent = signals[index % len(signals)]
            moment = MOMENTS[(index % len(signals) + index // len(signals) + seed) % len(MOMENTS)]
            fault = _draw_moment(rng, sent, moment)  # each signal meets every moment in 4 rounds
            run = work / f"matrix-{index}"
            harness = Harness((fault,))
            stopped = _matrix_run(train_cmd(recipe, f"run.output_dir={run}", harness=harness), in_process)
            problem = _check_signalled(run, stopped, fault)
            if problem is None:
                resumed = _matrix_run(train_cmd(recipe, f"run.output_dir={run}", resume=True), in_process)
                problem = (
                    run_difference(run, work / "matrix-reference")
                    if resumed.rc == 0
                    else f"the resume failed (exit {resumed.rc}):\n{resumed.tail()}"
                )
            outcome.count(f"{sent} {fault.phase}")
            outcome.record(problem, f"trial {index}: {fault.to_json()}")
        outcome.figures["bit-exact resumes"] = outcome.passed
    return outcome


def _draw_moment(rng: random.Random, sent: str, moment: str) -> Fault:
    if moment == "forward":
        return Fault("signal", step=rng.randint(1, MATRIX_STEPS), micro=rng.randint(1, 2), signal=sent)
    if moment == "save":  # a checkpoint before the last step: the run stops after the next one
        step = rng.choice(range(MATRIX_EVERY, MATRIX_STEPS, MATRIX_EVERY))
        file = rng.choice(("model.pt", "optimizer.pt", "rng_rank0.pt"))
        return Fault("signal", step=step, phase="save", file=file, signal=sent)
    return Fault("signal", phase=moment, signal=sent)


def _matrix_run(cmd: list[str], here: bool) -> Launch:
    """`cmd` (a `train_cmd`) as a process, or in this process through the same entry point."""
    if not here:
        proc = start(cmd)
        launched = finish(proc, time.perf_counter())
        return Launch(launched.rc, launched.output + _core_files(), launched.seconds)
    started = time.perf_counter()
    entry = faults.main if "fault_kit.faults" in cmd else cli.main
    rc, out, err = in_process(
        entry, cmd[cmd.index("fault_kit.faults" if entry is faults.main else "memtrain") + 1 :]
    )
    code = rc if isinstance(rc, int) else None
    return Launch(
        code, out + err + ("" if code is not None else f"\n{rc}"), round(time.perf_counter() - started, 2)
    )


def _core_files() -> str:
    """A line naming core files in this directory (where a child that dumped core left one)."""
    found = sorted(str(p) for p in Path.cwd().glob("core*") if p.is_file())
    return f"\ncore file(s) left: {found}" if found else ""


def _check_signalled(run: Path, stopped: Launch, fault: Fault) -> str | None:
    """The exit code, the one line, the checkpoint of the step in flight."""
    code = EXIT_INTERRUPTED if fault.signal == "SIGINT" else 0
    bad = ("Traceback", "core file", "core dumped")
    if stopped.rc != code or any(mark in stopped.output for mark in bad):
        return f"expected exit {code}, no traceback, no core, got {stopped.rc}:\n{stopped.tail()}"
    if fault.phase in ("plan", "planning"):
        line = "memtrain: interrupted" if fault.signal == "SIGINT" else f"memtrain: {fault.signal}: stopped"
        if not stopped.output.rstrip().splitlines()[-1].startswith(line):
            return f"the last line is not {line!r}:\n{stopped.tail()}"
        has = (run / "checkpoints").is_dir() and any(
            ckpt.STEP_DIR.match(p.name) for p in (run / "checkpoints").iterdir()
        )
        return f"a checkpoint exists after a stop before step 1:\n{stopped.tail()}" if has else None
    expected = fault.step + 1 if fault.phase == "save" else fault.step
    found = re.search(rf"{fault.signal}: stopped after step (\d+) with a checkpoint", stopped.output)
    if found is None or int(found.group(1)) != expected:
        return f"no line saying {fault.signal} stopped the run after step {expected}:\n{stopped.tail()}"
    newest = ckpt.find_checkpoint(run / "checkpoints").step
    return None if newest == expected else f"the newest checkpoint is step {newest}, expected {expected}"


# ---------------------------------------------------------------------------------------------- launcher


def launcher_death(work: Path, trials: int, seed: int, ranks: int = 2) -> Outcome:
    """SIGKILL to torchrun alone at a random step of a `ranks`-rank run: every rank must exit within
    LAUNCHER_DEATH_LIMIT_S. Ranks that outlive the limit are killed by pid, and the trial fails."""
    name = f"launcher death, {ranks} rank{'s' if ranks > 1 else ''}"
    outcome = Outcome(name, "SIGKILL to the torchrun launcher alone, mid-run")
    with timed(outcome):
        sections = {
            **SIGTERM_SECTIONS,
            "train": {
                "steps": 400,
                "warmup_steps": 2,
                "lr": 1e-2,
            },  # a minute of steps: longer than the limit
            "strategies": {"sharding": "ddp" if ranks > 1 else "none"},
        }
        recipe = write_recipe(work / "launcher.yaml", recipe_dict(work / "launcher", **sections))
        rng = random.Random(f"{seed}-launcher")
        slowest = 0.0
        for index in range(trials):
            run = work / f"launcher-{index}"
            started = time.perf_counter()
            proc = start(train_cmd(recipe, f"run.output_dir={run}", harness=SLOW_STEPS, ranks=ranks), DDP_ENV)
            seen = _wait_for_rows(run / "metrics.jsonl", rng.randint(2, 6), proc, timeout=120)
            workers = _children(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)  # the launcher only: its ranks are in other sessions
            killed = time.perf_counter()
            left = _wait_for_exit(workers, LAUNCHER_DEATH_LIMIT_S)
            seconds = time.perf_counter() - killed
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            output = finish(proc, started)  # the ranks held the launcher's output pipe until they left
            slowest = max(slowest, seconds)
            problem = None
            if len(workers) != ranks:
                problem = (
                    f"found {len(workers)} rank processes under torchrun, expected {ranks}:\n{output.tail()}"
                )
            elif left:
                problem = f"{len(left)} of {ranks} ranks still ran {seconds:.1f} s after the launcher died"
            elif "SIGTERM: stopped after step" in output.output:
                outcome.count("stopped with a checkpoint")
            outcome.record(problem, f"trial {index}: launcher killed after {seen} logged steps")
        outcome.figures["seconds until every rank exited (max)"] = round(slowest, 2)
    return outcome


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None and int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait_for_exit(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` runs (or `timeout` passed); return those still running."""
    deadline = time.perf_counter() + timeout
    running = [p for p in pids if _running(p)]
    while running and time.perf_counter() < deadline:
        time.sleep(0.05)
        running = [p for p in running if _running(p)]
    return running


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie lingers where its new parent does not reap it)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return fields is not None and fields[0] not in ("Z", "X")


def _stat_fields(stat: Path) -> list[str] | None:
    """/proc/PID/stat after the command name: state, parent pid, ... (None: no such process)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
