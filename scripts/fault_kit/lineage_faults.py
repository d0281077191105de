"""Fault scenarios for a run directory's integrity: rollbacks killed mid-way (run lineage), kills while a
checkpoint is replaced or pruned, two writers on one run directory, and a full disk while saving.

Why: these faults break what the other scenarios take for granted, that the checkpoints listed in a run
directory are the trajectory `--resume auto` should continue. Each scenario checks the result the way
a user meets it: exit codes and one-line errors, what `list_checkpoints` shows, metrics.jsonl, and the
final state compared bit for bit with an uninterrupted run. Like `fault_kit.scenarios`, a kill runs in
a real `memtrain train` process (`fault_kit.faults`); set-up and resumes that need no process boundary
run in this process for speed (the caller sets one torch thread, as for the other scenarios).
"""

from __future__ import annotations

import errno
import io
import json
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from memtrain import checkpoint as tensor_files
from memtrain import cli
from memtrain.run import RunLayout, lineage
from memtrain.run import checkpoints as ckpt
from memtrain.training.metrics import read_metrics

from fault_kit.faults import Fault, Harness
from fault_kit.scenarios import (
    CHECKPOINT_FILES,
    TINY_LLAMA,
    Outcome,
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

SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},  # dropout: the RNG state must resume too
    "train": {"steps": 8, "warmup_steps": 2, "lr": 1e-2},
    "checkpoint": {"every": 2, "keep": 4, "at_end": True},  # checkpoints 2, 4, 6, 8
}
ROLLBACK_STEP = 4
NEW_LR = "train.lr=0.003"
STEP_DELAY = Fault("delay", rank=-1, seconds=0.5)  # two writers overlap for the whole run


def run_args(recipe: Path, run: Path, *extra: str) -> list[str]:
    """`memtrain train` arguments for `recipe` in `run` (for `in_process(cli.main, ...)`)."""
    return ["train", str(recipe), f"run.output_dir={run}", *extra, "--no-progress"]


def rollback_args(run: Path) -> list[str]:
    """A rollback to ROLLBACK_STEP with another learning rate."""
    step = run / "checkpoints" / ckpt.step_dir_name(ROLLBACK_STEP)
    return [NEW_LR, "--resume", str(step), "--allow-recipe-change"]


def setup_runs(work: Path, outcome: Outcome, name: str, *runs: tuple[str, list[str]]) -> Path | None:
    """Write the scenario's recipe, then train each (run name, extra arguments) in this process; None
    (and a failed trial) when one fails."""
    recipe = write_recipe(work / f"{name}.yaml", recipe_dict(work / f"{name}-original", **SECTIONS))
    for run, extra in runs:
        rc, out, err = in_process(cli.main, run_args(recipe, work / run, *extra))
        if rc != 0:
            outcome.record(f"a set-up run failed ({rc}):\n{(out + err)[-600:]}", run)
            return None
    return recipe


# ---------------------------------------------------------------------------------------------- rollback


def draw_rollback_kill(rng: random.Random) -> Fault:
    """A kill in a rollback to step 4: while it moves the newer checkpoints aside (25%), mid-step (35%),
    or while a checkpoint of the new lineage is written (40%)."""
    draw = rng.random()
    if draw < 0.25:
        return Fault("kill", step=rng.choice((6, 8)), phase="truncate")
    if draw < 0.6:
        return Fault(
            "kill", step=rng.randint(5, 8), micro=rng.randint(1, 2), phase=rng.choice(("forward", "backward"))
        )
    return Fault(
        "kill",
        step=rng.choice((6, 8)),
        phase="save",
        file=rng.choice(CHECKPOINT_FILES),
        fraction=round(rng.random(), 3),
    )


def rollback_kill(work: Path, trials: int, seed: int, points: tuple[Fault, ...] = ()) -> Outcome:
    """A rollback (`--resume .../step_00000004 train.lr=... --allow-recipe-change`) killed at a point drawn
    from the seed (or one trial per given point), sometimes killed again in the `--resume auto` after it;
    then a plain `--resume auto` with the new recipe must continue the new lineage, end bit-identical to
    an uninterrupted rollback, and list no checkpoint of the abandoned one."""
    outcome = Outcome("rollback, then kill -9", "SIGKILL mid-truncation / mid-step / mid-checkpoint-file")
    with timed(outcome):
        original, reference = work / "rollback-original", work / "rollback-reference"
        recipe = setup_runs(work, outcome, "rollback", (original.name, []))
        if recipe is None:
            return outcome
        shutil.copytree(original, reference)
        rc, out, err = in_process(cli.main, run_args(recipe, reference, *rollback_args(reference)))
        if rc != 0:
            outcome.record(f"the uninterrupted rollback failed ({rc}):\n{(out + err)[-600:]}", "reference")
            return outcome
        template = final_state(reference)["model"]
        for index in range(len(points) or trials):
            rng = random.Random(f"{seed}-rollback-{index}")
            run = work / f"rollback-{index:02d}"
            shutil.copytree(original, run)
            kill = points[index] if points else draw_rollback_kill(rng)
            again = None if points or rng.random() < 0.6 else Fault("kill", step=rng.randint(5, 8))
            problem = _rollback_trial(recipe, run, kill, again, template, reference)
            label = f"trial {index} ({kill.to_json()}{f'; then {again.to_json()}' if again else ''})"
            outcome.record(problem, label)
            outcome.count(
                {"truncate": "mid-truncation", "save": "mid-checkpoint-file"}.get(kill.phase, "mid-step")
            )
            outcome.count("second kills", again is not None)
        outcome.figures["bit-exact continuations of the new lineage"] = outcome.passed
    return outcome


def _rollback_trial(
    recipe: Path, run: Path, kill: Fault, again: Fault | None, template: Any, reference: Path
) -> str | None:
    died = launch(train_cmd(recipe, f"run.output_dir={run}", *rollback_args(run), harness=Harness((kill,))))
    if died.rc != -signal.SIGKILL:
        return f"expected death by SIGKILL, got exit {died.rc}\n{died.tail()}"
    if again is not None:  # a fault that fires only if the resume reaches its step
        second = launch(
            train_cmd(recipe, f"run.output_dir={run}", NEW_LR, harness=Harness((again,)), resume=True)
        )
        if second.rc not in (0, -signal.SIGKILL):
            return f"the first --resume auto failed (exit {second.rc}):\n{second.tail()}"
    problem = audit_checkpoints(run / "checkpoints", template)
    if problem is not None:
        return problem
    rc, out, err = in_process(cli.main, run_args(recipe, run, NEW_LR, "--resume", "auto"))
    if rc != 0:
        return f"--resume auto without {lineage.FLAG} failed ({rc}):\n{(out + err)[-600:]}"
    return run_difference(run, reference) or lineage_problem(run)


def lineage_problem(run: Path) -> str | None:
    """None when every checkpoint past the rollback step belongs to the new lineage, the abandoned ones
    (steps 6 and 8 of the original) are each kept once under abandoned/, and so are their metrics rows."""
    truncations = [r for r in lineage.read_records(run) if r.get("event") == "truncate"]
    if len(truncations) != 1:
        return f"lineage.jsonl records {len(truncations)} truncations, expected 1"
    new = truncations[0]["lineage"]
    for found in ckpt.list_checkpoints(run / "checkpoints"):
        if found.step > ROLLBACK_STEP and found.meta.get("lineage") != new:
            return f"{found.path} is not of the new lineage {new}"
    abandoned = RunLayout(run).abandoned
    moved = sorted(p.name for p in abandoned.glob("*/step_*"))
    if moved != [ckpt.step_dir_name(6), ckpt.step_dir_name(8)]:
        return f"abandoned/ holds {moved}, expected the original's steps 6 and 8 once each"
    rows = {r["step"] for f in abandoned.glob("*/metrics.jsonl") for r in read_metrics(f)}
    return (
        None if rows >= {5, 6, 7, 8} else f"abandoned metrics rows {sorted(rows)}: the original's 5-8 missing"
    )


# ---------------------------------------------------------------------------------------------- replace


def replace_kill(work: Path, trials: int, seed: int) -> Outcome:
    """Kills while a checkpoint is replaced (a fallback from a damaged newest checkpoint saves its step
    again: killed between renaming the old one aside and the new one in, or while deleting the old one)
    and while one is pruned (keep 2; sometimes in the last save, after which a resume trains nothing).
    Every listed checkpoint must be whole after the kill, no staging or trash directory may outlive the
    next start, and the run must end bit-identical to an uninterrupted one."""
    outcome = Outcome(
        "kill -9 in replace / prune", "SIGKILL between the renames of a replace, mid-delete, mid-prune"
    )
    with timed(outcome):
        keep_two = ["checkpoint.keep=2"]
        recipe = setup_runs(work, outcome, "replace", ("replace-original", keep_two))
        if recipe is None:
            return outcome
        original = work / "replace-original"
        template = final_state(original)["model"]
        rng = random.Random(f"{seed}-replace")
        for index in range(trials):
            run = work / f"replace-{index:02d}"
            kind = rng.choice(("replace", "replace-delete", "prune"))
            if kind == "prune":
                kill = Fault("kill", step=rng.choice((6, 8)), phase="prune")
                extra = [*keep_two]
            else:  # step 8 is damaged (loads, but does not fit): a fallback saves step 8 again
                shutil.copytree(original, run)
                misfit(run / "checkpoints" / ckpt.step_dir_name(8) / "optimizer.pt")
                kill = Fault("kill", step=8, phase="replace" if kind == "replace" else "prune")
                extra = [*keep_two, "checkpoint.fallback=true"]
            outcome.record(
                _replace_trial(recipe, run, kill, extra, template, original),
                f"trial {index}: {kind} ({kill.to_json()})",
            )
            outcome.count(kind)
        outcome.figures["bit-exact resumes"] = outcome.passed
    return outcome


def misfit(optimizer_file: Path) -> None:
    """An optimizer.pt that loads but does not fit the model (memtrain refuses it; fallback skips it)."""
    state = torch.load(optimizer_file, weights_only=True)
    state["state"][0]["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, optimizer_file)


def _replace_trial(
    recipe: Path, run: Path, kill: Fault, extra: list[str], template: Any, original: Path
) -> str | None:
    died = launch(train_cmd(recipe, f"run.output_dir={run}", *extra, harness=Harness((kill,)), resume=True))
    if died.rc != -signal.SIGKILL:
        return f"expected death by SIGKILL, got exit {died.rc}\n{died.tail()}"
    root = run / "checkpoints"
    problem = audit_checkpoints(root, template)
    if problem is not None:
        return f"after the kill: {problem}"
    rc, out, err = in_process(cli.main, run_args(recipe, run, *extra, "--resume", "auto"))
    if rc != 0:
        return f"--resume auto failed ({rc}):\n{(out + err)[-600:]}"
    left = sorted(p.name for p in root.iterdir() if not ckpt.STEP_DIR.match(p.name))
    if left:
        return f"left in {root} after the next start: {left}"
    return run_difference(run, original)


# ---------------------------------------------------------------------------------------------- writers


def concurrent_writers(work: Path, trials: int, seed: int) -> Outcome:
    """Two `memtrain train` processes on one run directory, started together (the second up to 1 s
    later): both fresh (even trials), or both `--resume auto` on a run with 2 steps done (odd trials).
    Exactly one must train; the other must exit 2 with one line naming the holder's pid, without a
    traceback; metrics.jsonl must hold every step once and the run must equal an uninterrupted one."""
    outcome = Outcome(
        "two writers, one run directory", "two fresh runs / two --resume auto, started together"
    )
    with timed(outcome):
        recipe = setup_runs(work, outcome, "writers", ("writers-original", []))
        if recipe is None:
            return outcome
        started = work / "writers-start"
        shutil.copytree(work / "writers-original", started)
        cut_after(started, 2)
        rng = random.Random(f"{seed}-writers")
        for index in range(trials):
            run = work / f"writers-{index:02d}"
            resume = index % 2 == 1
            if resume:
                shutil.copytree(started, run)
            lag = round(rng.uniform(0.0, 1.0), 2)
            problem = _two_writers(recipe, run, resume, lag)
            outcome.record(
                problem or run_difference(run, work / "writers-original"),
                f"trial {index}: {'--resume auto' if resume else 'fresh'}, second {lag} s later",
            )
            outcome.count("--resume auto pairs" if resume else "fresh pairs")
        outcome.figures["runs with exactly one writer"] = outcome.passed
    return outcome


def cut_after(run: Path, step: int) -> None:
    """Leave `run` as a run killed right after its checkpoint of `step`: no later checkpoint or row."""
    for found in ckpt.list_checkpoints(run / "checkpoints"):
        if found.step > step:
            shutil.rmtree(found.path)
    metrics = run / "metrics.jsonl"
    rows = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
    metrics.write_text("".join(row + "\n" for row in rows))


def _two_writers(recipe: Path, run: Path, resume: bool, lag: float) -> str | None:
    cmd = train_cmd(recipe, f"run.output_dir={run}", harness=Harness((STEP_DELAY,)), resume=resume)
    started = time.perf_counter()
    first = start(cmd)
    time.sleep(lag)
    second = start(cmd)
    ends = [(finish(first, started), first.pid), (finish(second, started), second.pid)]
    codes = sorted(end.rc for end, _ in ends if end.rc is not None)
    if codes != [0, 2]:
        return "exit codes " + ", ".join(f"{end.rc}:\n{end.tail()}" for end, _ in ends)
    (loser, _), (_, winner) = sorted(ends, key=lambda e: e[0].rc == 0)
    errors = [line for line in loser.output.splitlines() if "error" in line]
    if "Traceback" in loser.output or len(errors) != 1 or f"in use by pid {winner} " not in errors[0]:
        return f"the second writer's error does not name pid {winner} in one line:\n{loser.output[-800:]}"
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    return None if steps == list(range(1, 9)) else f"metrics.jsonl steps {steps}"


# ---------------------------------------------------------------------------------------------- disk full


class _FullDisk(io.RawIOBase):
    """A file that takes `room` bytes, then fails like a full disk (torch.save wraps that error)."""

    def __init__(self, handle: Any, room: int, code: int) -> None:
        self.handle, self.room, self.code = handle, room, code

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if len(data) > self.room:
            self.handle.write(bytes(data[: self.room]))
            raise OSError(self.code, f"injected by fault_kit: {os.strerror(self.code)}")
        self.room -= len(data)
        return int(self.handle.write(data))


@contextmanager
def full_disk(step: int, file: str, room: int, code: int) -> Iterator[None]:
    """Make `file` of checkpoint `step` hit a full disk after `room` bytes."""
    real_write = tensor_files.write_file

    def write_file(path: Path, write: Callable[[Any], None]) -> None:
        if path.name == file and path.parent == ckpt.staging_dir(path.parent.parent, step):
            real_write(path, lambda handle: write(_FullDisk(handle, room, code)))
        else:
            real_write(path, write)

    with mock.patch.object(tensor_files, "write_file", write_file):
        yield


def disk_full(work: Path, trials: int, seed: int) -> Outcome:
    """ENOSPC (or EDQUOT) while a file of a checkpoint is written, in this process: exit 2 with one line
    naming the directory and the intact previous checkpoint, no staging directory left, the previous
    checkpoint the newest; then `--resume auto` must end bit-identical to an uninterrupted run."""
    outcome = Outcome("disk full", "ENOSPC / EDQUOT part-way through a checkpoint file")
    with timed(outcome):
        recipe = setup_runs(work, outcome, "diskfull", ("diskfull-original", []))
        if recipe is None:
            return outcome
        rng = random.Random(f"{seed}-diskfull")
        for index in range(trials):
            run = work / f"diskfull-{index:02d}"
            step, file = rng.choice((2, 4, 6, 8)), rng.choice(CHECKPOINT_FILES)
            code, room = rng.choice((errno.ENOSPC, errno.EDQUOT)), rng.randrange(0, 512)  # < any file
            with full_disk(step, file, room, code):
                rc, out, err = in_process(cli.main, run_args(recipe, run))
            problem = _disk_full_problem(run / "checkpoints", step, rc, err)
            if problem is None:
                rc, out, err = in_process(cli.main, run_args(recipe, run, "--resume", "auto"))
                problem = (
                    run_difference(run, work / "diskfull-original")
                    if rc == 0
                    else f"resume: {rc} {err[-400:]}"
                )
            outcome.record(
                problem, f"trial {index}: {errno.errorcode[code]} in {file} of step {step} after {room} bytes"
            )
            outcome.count(errno.errorcode[code])
        outcome.figures["clear errors, then bit-exact resumes"] = outcome.passed
    return outcome


def _disk_full_problem(root: Path, step: int, rc: Any, err: str) -> str | None:
    lines = [line for line in err.splitlines() if "error" in line or "Traceback" in line]
    intact = f"(step {step - 2}) is intact" if step > 2 else "no earlier checkpoint"
    if rc != 2 or len(lines) != 1 or str(root) not in lines[0] or intact not in lines[0]:
        return f"expected exit 2 and one line naming {root} and '{intact}'; got {rc}: {err[-500:]}"
    listed = [c.step for c in ckpt.list_checkpoints(root)]
    if (listed[-1] if listed else 0) != step - 2 or list(root.glob("*.tmp")):
        return f"after the error: checkpoints {listed}, staging {sorted(p.name for p in root.glob('*.tmp'))}"
    return None
