"""memtrain's own files in a run directory are input too (issue #28): every file memtrain writes there,
damaged five ways (empty, random bytes, the wrong JSON type, a directory in its place, a symlink loop),
makes `memtrain train --resume auto` and `memtrain export` exit 2 with one line naming it, or do the
documented repair; never a traceback, and no checkpoint is lost. Also the step-time cache (`memtrain
plan`) and a full disk while writing plan.json during a rollback.

The holes these tests found (each fails on the code before the fix): random bytes in lineage.jsonl or
metrics.jsonl raised `UnicodeDecodeError`; a directory at lineage.jsonl, plan.json, summary.json or the
lock, and a symlink loop at lineage.jsonl or the lock, raised `OSError`s (a directory at recipe.json
too, after training); a `checkpoints` file or symlink loop made `--resume auto` train from step 0 and
then fail to save (the trained steps lost); a complete lineage.jsonl line of the wrong type was silently
skipped; a cached step time of 0 crashed every `plan` and `train` though the cache is documented as
ignored when unreadable; a full disk while writing plan.json was an `OSError` traceback.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from memtrain import cli
from memtrain.planner import step_time_calibration as stc
from memtrain.run import RunLayout
from memtrain.run import checkpoints as ckpt

from fault_kit.run_dir_faults import copy_of, damage
from fault_kit.scenarios import in_process, recipe_dict, write_recipe
from helpers import tiny_recipe_dict

DAMAGES = ("empty", "random bytes", "wrong JSON type", "directory", "symlink loop")


def own_files(run: Path) -> dict[str, Path]:
    """Every file memtrain writes in a finished run (the newest checkpoint's meta.json among them)."""
    layout = RunLayout(run)
    names = ("recipe_file", "plan_file", "summary_file", "metrics_file", "lineage_file", "lock_file")
    files = {getattr(layout, name).name: getattr(layout, name) for name in names}
    newest = ckpt.list_checkpoints(layout.checkpoints)[-1]
    files["meta.json"] = newest.files.meta
    return files


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2, and its recipe (train.steps: 2)."""
    base = tmp_path_factory.mktemp("finished")
    raw = tiny_recipe_dict(base, train={"steps": 2}, checkpoint={"every": 1, "keep": 3, "at_end": True})
    recipe = write_recipe(base / "recipe.yaml", raw)
    rc, _, err = in_process(cli.main, ["train", str(recipe)])
    assert rc == 0, err
    return base


def checkpoint_trees(run: Path) -> dict[str, bytes]:
    """Every checkpoint file's bytes (model, optimizer, RNG), wherever it is in the run, by step name
    and file name: what must not be lost."""
    trees: dict[str, bytes] = {}
    for step_dir in sorted(run.rglob("step_*")):
        if ckpt.STEP_DIR.match(step_dir.name) and step_dir.is_dir():
            for file in step_dir.glob("*.pt"):
                trees[f"{step_dir.name}/{file.name}"] = file.read_bytes()
    return trees


def one_line_or_ok(rc: Any, err: str, names: str) -> str | None:
    """None when the command ended as required: exit 0, or exit 2 with one error line naming `names`."""
    if "Traceback" in str(rc) or "Traceback" in err:
        return f"traceback: {rc} {err[-800:]}"
    if rc == 0:
        return None
    errors = [line for line in err.splitlines() if ": error: " in line]
    if rc != 2 or len(errors) != 1 or names not in err:  # (a recipe problem lists itself under its line)
        return f"exit {rc}, error lines {errors}"
    return None


def test_every_own_file_damaged_is_one_line_or_repaired_and_loses_nothing(
    finished: Path, tmp_path: Path
) -> None:
    """The matrix: each file x each damage, through export and `train --resume auto`. (Before the fix the
    empty and wrong-JSON-type columns held; random bytes, a directory and a symlink loop did not.)"""
    problems = []
    for name, how in itertools.product(own_files(finished / "run"), DAMAGES):
        work = tmp_path / f"{name}-{how}"
        recipe, run = copy_of(finished, work)
        before = checkpoint_trees(run)
        damage(own_files(run)[name], how, name)
        rc, out, err = in_process(cli.main, ["export", str(run), "--out", str(work / "hf")])
        problem = one_line_or_ok(rc, err, name)
        rc, out, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=3"])
        problem = problem or one_line_or_ok(rc, err, name)
        after = checkpoint_trees(run)
        if problem is None and any(after.get(key) != value for key, value in before.items()):
            problem = "a checkpoint file was lost or changed"
        if problem is None and rc == 0 and "step_00000003/model.pt" not in after:
            problem = "exit 0 without training step 3"
        if problem is not None:
            problems.append(f"{name} ({how}): {problem}")
    assert problems == []


def test_a_checkpoints_symlink_loop_is_one_line_and_trains_nothing(finished: Path, tmp_path: Path) -> None:
    """A symlink loop where checkpoints/ was: `--resume auto` used to see no checkpoint, train from step 0
    and fail at the first save (the steps it trained lost, with a traceback). (A file there is the
    preflight's error already.)"""
    recipe, run = copy_of(finished, tmp_path)
    damage(RunLayout(run).checkpoints, "symlink loop", "checkpoints")
    rc, out, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto"])
    assert one_line_or_ok(rc, err, "checkpoints") is None and rc == 2, err
    assert "step 1" not in out  # nothing trained


def test_a_damaged_lineage_record_of_the_right_json_type_is_refused(finished: Path, tmp_path: Path) -> None:
    """A complete line whose fields are not what memtrain writes (an event it never writes, a steps list of
    strings) was taken as it came."""
    recipe, run = copy_of(finished, tmp_path)
    lineage = RunLayout(run).lineage_file
    good = lineage.read_text()
    record = {
        "event": "truncate",
        "lineage": "x",
        "parent": None,
        "moved_steps": ["2"],
        "abandoned": "abandoned/a",
    }
    lineage.write_text(good + json.dumps(record) + "\n")
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=3"])
    assert rc == 2 and "lineage.jsonl: line 2" in err and "moved_steps" in err, err
    assert [c.step for c in ckpt.list_checkpoints(RunLayout(run).checkpoints)] == [1, 2]


def test_a_line_cut_by_a_crash_is_left_out_and_cut_off_at_the_next_record(
    finished: Path, tmp_path: Path
) -> None:
    """The documented repair: a last line without its newline (a crash mid-write) is not a record; the
    next start appends after the last whole line, so the file stays readable."""
    recipe, run = copy_of(finished, tmp_path)
    lineage = RunLayout(run).lineage_file
    lineage.write_bytes(lineage.read_bytes() + b'{"event": "trunc')
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=3"])
    assert rc == 0, err
    lines = lineage.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["start", "resume"]


# ---------------------------------------------------------------------------------------------- the cache


def step_time_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(recipe, cache file) after one `memtrain plan` filled this machine's step-time cache."""
    monkeypatch.setenv(stc.CACHE_ENV, str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_recipe_dict(tmp_path))
    rc, _, err = in_process(cli.main, ["plan", str(recipe)])
    cache = tmp_path / "cache" / stc.CACHE_FILE
    assert rc == 0 and cache.is_file(), err
    return recipe, cache


def nonpositive_times(cache: Path) -> None:
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        for timings in entry["probes"].values():
            for sample in timings:
                sample["seconds"] = 0.0
    cache.write_text(json.dumps(entries))


CACHE_DAMAGES: dict[str, Callable[[Path], None]] = {
    **{how: (lambda path, how=how: damage(path, how, path.name)) for how in DAMAGES},
    "non-positive step times": nonpositive_times,
}


def test_a_damaged_step_time_cache_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe, cache = step_time_cache(tmp_path, monkeypatch)
    kept = cache.read_bytes()
    problems = []
    for name, spoil in CACHE_DAMAGES.items():
        if os.path.lexists(cache) and (cache.is_symlink() or cache.is_dir()):
            damage(cache, "empty", cache.name)
        cache.write_bytes(kept)
        spoil(cache)
        rc, out, err = in_process(cli.main, ["plan", str(recipe)])
        warned = "step-time" in err or name in ("empty", "symlink loop")  # (replaced by a new cache)
        if rc != 0 or "Traceback" in err or not warned:
            problems.append(f"{name}: exit {rc}: {err[-600:]}")
    assert problems == []


# ---------------------------------------------------------------------------------------------- full disk


def test_a_full_disk_writing_plan_json_in_a_rollback_is_the_disk_full_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollback (a resume from an older checkpoint, which truncates the run) whose plan.json write hits
    ENOSPC: an `OSError` traceback before; now the one disk-full line, and the truncated checkpoint is
    under abandoned/ as documented."""
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(run, train={"steps": 4}))
    assert in_process(cli.main, ["train", str(recipe)])[0] == 0
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if ".plan.json." in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    older = RunLayout(run).checkpoints / "step_00000002"
    rc, _, err = in_process(
        cli.main, ["train", str(recipe), "--resume", str(older), "train.lr=0.005", "--allow-recipe-change"]
    )
    monkeypatch.undo()
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "no space left on the device" in errors[0] and str(RunLayout(run).plan_file) in errors[0]
    assert [c.step for c in ckpt.list_checkpoints(RunLayout(run).checkpoints)] == [2]
    assert [p.name for p in RunLayout(run).abandoned.glob("*/step_*")] == ["step_00000004"]
    assert not list(run.glob(".plan.json.*"))  # no temporary file left
