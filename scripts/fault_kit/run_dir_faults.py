"""Fault scenario: a run directory as hostile input. memtrain's own files damaged (empty, random bytes, the
wrong JSON type, a directory, a symlink loop), and symlinks planted to make memtrain write outside the
run (at the lock file, lineage.jsonl, metrics.jsonl, plan.json, summary.json, a temporary name, the
checkpoints and abandoned folders, a staging directory, a lineage record's abandoned folder).

Why: a run directory is shared and copied around, and memtrain writes into it as whoever resumes or
exports it. Each trial checks what a user (or the owner of a file outside the run) meets: `memtrain
train --resume auto` and `memtrain export` exit 0 or exit 2 with one line, no traceback, every
checkpoint file still in the run (or set aside under abandoned/ as documented), and a file outside
the run unchanged, byte for byte and in its mtime. Everything runs in this process (`in_process`).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtrain import cli
from memtrain.run import RunLayout
from memtrain.run import checkpoints as ckpt

from fault_kit.scenarios import Outcome, in_process, recipe_dict, timed, write_recipe

DAMAGES = ("empty", "random bytes", "wrong JSON type", "directory", "symlink loop")
FILES = ("recipe_file", "plan_file", "summary_file", "metrics_file", "lineage_file", "lock_file")
PLANTED = ("lock_file", "lineage_file", "metrics_file", "plan_file", "summary_file")
SECRET = b"a file outside the run\n"


def damage(path: Path, how: str, seed: str) -> None:
    """Put `how` in the place of the file `path`."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "random bytes":
        path.write_bytes(random.Random(seed).randbytes(4096))
    elif how == "wrong JSON type":
        path.write_text('["a list", 1]\n')
    elif how == "directory":
        path.mkdir()
        (path / "inside").write_text("x")
    else:
        path.symlink_to(path.name)  # a link to itself


def copy_of(finished: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(recipe, run) of a copy of the finished run under `finished` (its `run/`), placed under `tmp_path`."""
    run = tmp_path / "run"
    shutil.copytree(finished / "run", run, symlinks=True)
    raw = json.loads((run / "recipe.json").read_text())
    raw["run"]["output_dir"] = str(run)
    return write_recipe(tmp_path / "recipe.yaml", raw), run


def checkpoint_files(run: Path) -> dict[str, bytes]:
    """Every checkpoint tensor file anywhere in the run (checkpoints/ or abandoned/), by step and name."""
    return {
        f"{d.name}/{f.name}": f.read_bytes()
        for d in sorted(run.rglob("step_*"))
        if ckpt.STEP_DIR.match(d.name) and d.is_dir()
        for f in d.glob("*.pt")
    }


def ended_well(rc: Any, err: str) -> str | None:
    """None for exit 0, or exit 2 with one error line; else what happened."""
    if "Traceback" in str(rc) or "Traceback" in err:
        return f"traceback: {str(rc)[:200]} {err[-400:]}"
    errors = [line for line in err.splitlines() if ": error: " in line]
    if rc == 0 or (rc == 2 and len(errors) == 1):
        return None
    return f"exit {rc} with {len(errors)} error lines: {err[-400:]}"


class Outside:
    """A file outside the run that no trial may change."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        self.folder, self.file = folder, folder / "precious.txt"
        self.file.write_bytes(SECRET)
        self.stamp = self.file.stat().st_mtime_ns

    def changed(self) -> str | None:
        same = self.file.read_bytes() == SECRET and self.file.stat().st_mtime_ns == self.stamp
        names = sorted(p.name for p in self.folder.iterdir())
        return None if same and names == ["precious.txt"] else f"the file outside changed (folder: {names})"


def run_dir_faults(work: Path, seed: int, damages: int | None = None) -> Outcome:
    """Every own file x every damage (or `damages` of those pairs, drawn from the seed: the CI subset), then
    every planted symlink; see the module docstring."""
    outcome = Outcome(
        "run directory as input",
        "own files damaged 5 ways; symlinks out of the run; a lineage record pointing outside",
    )
    with timed(outcome):
        recipe = work / "base" / "recipe.yaml"
        write_recipe(
            recipe, recipe_dict(work / "base" / "run", train={"steps": 3}, checkpoint={"every": 2, "keep": 3})
        )
        rc, _, err = in_process(cli.main, ["train", str(recipe)])
        if rc != 0:
            outcome.record(f"setup run: {rc} {err[-400:]}", "setup")
            return outcome
        pairs = list(itertools.product(FILES, DAMAGES))
        if damages is not None:
            pairs = random.Random(f"{seed}-run-dir").sample(pairs, damages)
        for name, how in pairs:
            _trial(
                outcome,
                work,
                f"{name}-{how}",
                lambda run, o, name=name, how=how: damage(getattr(RunLayout(run), name), how, f"{seed}"),
            )
        for name in PLANTED:
            _trial(
                outcome,
                work,
                f"{name} -> outside",
                lambda run, o, name=name: _plant(getattr(RunLayout(run), name), o.file),
            )
        for name, plant in PLANTS.items():
            _trial(outcome, work, name, plant)
    return outcome


def _plant(path: Path, target: Path) -> None:
    path.unlink(missing_ok=True)
    path.symlink_to(target)


def _abandoned_outside(run: Path, outside: Outside) -> None:
    record = {
        "event": "truncate",
        "lineage": "x",
        "parent": None,
        "moved_steps": [3],
        "abandoned": "../outside",
    }
    with RunLayout(run).lineage_file.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


PLANTS: dict[str, Callable[[Path, Outside], None]] = {
    "checkpoints -> outside": lambda run, o: (
        shutil.rmtree(RunLayout(run).checkpoints),
        RunLayout(run).checkpoints.symlink_to(o.folder),
    ),
    "abandoned -> outside": lambda run, o: RunLayout(run).abandoned.symlink_to(o.folder),
    "staging -> outside": lambda run, o: ckpt.staging_dir(RunLayout(run).checkpoints, 4).symlink_to(o.folder),
    "summary.json.tmp -> outside": lambda run, o: (run / "summary.json.tmp").symlink_to(o.file),
    "lineage record abandoned: ../outside": _abandoned_outside,
    "checkpoints symlink loop": lambda run, o: (
        shutil.rmtree(RunLayout(run).checkpoints),
        RunLayout(run).checkpoints.symlink_to("checkpoints"),
    ),
}


def _trial(outcome: Outcome, work: Path, label: str, spoil: Callable[[Path, Outside], Any]) -> None:
    """Copy the base run, spoil it, export and resume it (to step 4), and check what is required."""
    trial = work / f"trial-{outcome.trials:03d}"
    run = trial / "run"
    shutil.copytree(work / "base" / "run", run, symlinks=True)
    raw = json.loads((run / "recipe.json").read_text())
    raw["run"]["output_dir"] = str(run)
    recipe = write_recipe(trial / "recipe.yaml", raw)
    outside = Outside(trial / "outside")
    spoil(run, outside)
    before = checkpoint_files(run)  # (what a spoiled checkpoints/ still holds)
    rc, _, err = in_process(cli.main, ["export", str(run), "--out", str(trial / "hf")])
    problem = ended_well(rc, err)
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    problem = problem or ended_well(rc, err) or outside.changed()
    after = checkpoint_files(run)
    if problem is None and any(after.get(key) != value for key, value in before.items()):
        problem = "a checkpoint file was lost or changed"
    outcome.count("exit 2, one line" if rc == 2 else "exit 0 (repaired or harmless)")
    if problem is not None and "Traceback" in problem:
        outcome.count("tracebacks")
    outcome.figures.setdefault("tracebacks", 0)
    outcome.record(problem, label)
    shutil.rmtree(trial, ignore_errors=True)
