"""A run directory cannot make memtrain write outside it (issue #28): symlinks planted at the lock file,
lineage.jsonl, metrics.jsonl, a JSON file's temporary name, the checkpoints or abandoned folder, a
staging directory, or the export's staging and output names, and a lineage record naming a folder
outside the run, never change a file outside the run (its bytes and mtime are checked) and never end in
a traceback.

The holes (each test fails on the code before the fix): the lock's `O_CREAT` + truncate emptied a
symlink's target; lineage.jsonl and metrics.jsonl were appended through symlinks; `summary.json.tmp` and
`metrics.jsonl.tmp` were written through symlinks; a `checkpoints` symlink to another directory was
written into; a lineage record with `abandoned: ../somewhere` moved checkpoints out of the run, which
then resumed from an older step with exit 0; a symlinked `step_X.tmp` gave a `FileExistsError`
traceback; `memtrain export --out OUT` deleted an existing `OUT.tmp/` holding someone's files, wrote a
fake newest checkpoint with `--out R/checkpoints/step_9`, and gave a traceback on a dangling `--out`
symlink.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from memtrain import cli
from memtrain.causal_lm.export import export_hf
from memtrain.run import RunLayout
from memtrain.run import checkpoints as ckpt

from fault_kit.run_dir_faults import copy_of
from fault_kit.scenarios import in_process, write_recipe
from helpers import tiny_recipe_dict

SECRET = b"someone else's file\n"


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run: checkpoints at steps 2 and 3, metrics rows 1-3."""
    base = tmp_path_factory.mktemp("finished")
    raw = tiny_recipe_dict(base, train={"steps": 3}, checkpoint={"every": 2, "keep": 3, "at_end": True})
    recipe = write_recipe(base / "recipe.yaml", raw)
    rc, _, err = in_process(cli.main, ["train", str(recipe)])
    assert rc == 0, err
    return base


class Outside:
    """A file outside the run directory, and a folder beside it, that nothing may change."""

    def __init__(self, tmp_path: Path) -> None:
        self.folder = tmp_path / "outside"
        self.folder.mkdir()
        self.file = self.folder / "precious.txt"
        self.file.write_bytes(SECRET)
        os.utime(self.file, (1_000_000_000, 1_000_000_000))
        self.stamp = self.file.stat().st_mtime_ns

    def unchanged(self) -> bool:
        return (
            self.file.read_bytes() == SECRET
            and self.file.stat().st_mtime_ns == self.stamp
            and sorted(p.name for p in self.folder.iterdir()) == ["precious.txt"]
        )


def no_traceback(rc: object, err: str) -> bool:
    return "Traceback" not in str(rc) and "Traceback" not in err


def one_error_line(err: str) -> list[str]:
    return [line for line in err.splitlines() if ": error: " in line]


def steps(run: Path) -> list[int]:
    return [c.step for c in ckpt.list_checkpoints(RunLayout(run).checkpoints)]


@pytest.mark.parametrize("name", ["lock_file", "lineage_file", "metrics_file", "plan_file", "summary_file"])
def test_a_run_file_symlinked_outside_is_refused_before_anything_is_written(
    finished: Path, tmp_path: Path, name: str
) -> None:
    recipe, run = copy_of(finished, tmp_path)
    outside = Outside(tmp_path)
    path = getattr(RunLayout(run), name)
    path.unlink()
    path.symlink_to(outside.file)
    rc, out, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    errors = one_error_line(err)
    assert rc == 2 and no_traceback(rc, err) and len(errors) == 1 and path.name in errors[0], err
    assert outside.unchanged() and steps(run) == [2, 3]


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl"])
def test_a_symlink_at_a_temporary_name_is_never_written_through(
    finished: Path, tmp_path: Path, name: str
) -> None:
    """summary.json is written at the end of every run, metrics.jsonl rewritten by a resume that sets
    rows aside (row 3 is past the resumed step 2): both went through `<name>.tmp`."""
    recipe, run = copy_of(finished, tmp_path)
    outside = Outside(tmp_path)
    (run / f"{name}.tmp").symlink_to(outside.file)
    resume = str(RunLayout(run).checkpoints / "step_00000002")
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", resume, "train.steps=4"])
    assert rc == 0 and no_traceback(rc, err), err
    assert outside.unchanged() and steps(run) == [2, 4]


def test_a_checkpoints_symlink_outside_is_refused(finished: Path, tmp_path: Path) -> None:
    recipe, run = copy_of(finished, tmp_path)
    outside = Outside(tmp_path)
    root = RunLayout(run).checkpoints
    shutil.rmtree(root)
    root.symlink_to(outside.folder)
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    assert rc == 2 and no_traceback(rc, err) and "outside the run directory" in err, err
    assert outside.unchanged()


def test_a_symlinked_staging_directory_is_unlinked_not_followed(finished: Path, tmp_path: Path) -> None:
    recipe, run = copy_of(finished, tmp_path)
    outside = Outside(tmp_path)
    staging = ckpt.staging_dir(RunLayout(run).checkpoints, 4)
    staging.symlink_to(outside.folder, target_is_directory=True)
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    assert rc == 0 and no_traceback(rc, err), err
    assert outside.unchanged() and steps(run) == [2, 3, 4] and not os.path.lexists(staging)


def test_a_lineage_record_pointing_outside_the_run_is_refused_not_followed(
    finished: Path, tmp_path: Path
) -> None:
    """An unfinished truncation whose `abandoned` folder is `../somewhere`: the next start used to move
    step 3 there and resume from step 2 with exit 0."""
    recipe, run = copy_of(finished, tmp_path)
    lineage = RunLayout(run).lineage_file
    record = {
        "event": "truncate",
        "lineage": "abc",
        "parent": None,
        "moved_steps": [3],
        "abandoned": "../somewhere",
    }
    lineage.write_text(lineage.read_text() + json.dumps(record) + "\n")
    rc, out, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    errors = one_error_line(err)
    assert rc == 2 and no_traceback(rc, err) and len(errors) == 1, err
    assert "lineage.jsonl: line 2" in errors[0] and "../somewhere" in errors[0]
    assert steps(run) == [2, 3] and not (tmp_path / "somewhere").exists()


def test_an_abandoned_folder_symlinked_outside_is_refused_before_a_rollback(
    finished: Path, tmp_path: Path
) -> None:
    recipe, run = copy_of(finished, tmp_path)
    outside = Outside(tmp_path)
    RunLayout(run).abandoned.symlink_to(outside.folder, target_is_directory=True)
    resume = str(RunLayout(run).checkpoints / "step_00000002")
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", resume])
    assert rc == 2 and no_traceback(rc, err) and "abandoned" in err, err
    assert outside.unchanged() and steps(run) == [2, 3]


def test_a_lock_path_that_is_a_directory_is_one_line(finished: Path, tmp_path: Path) -> None:
    recipe, run = copy_of(finished, tmp_path)
    lock = RunLayout(run).lock_file
    lock.unlink()
    lock.mkdir()
    rc, _, err = in_process(cli.main, ["train", str(recipe), "--resume", "auto", "train.steps=4"])
    errors = one_error_line(err)
    assert rc == 2 and no_traceback(rc, err) and len(errors) == 1 and ".memtrain.lock" in errors[0], err
    assert steps(run) == [2, 3]


def test_a_dangling_output_dir_symlink_is_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.symlink_to(tmp_path / "missing")
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_recipe_dict(tmp_path, train={"steps": 1}))
    rc, out, err = in_process(cli.main, ["train", str(recipe)])
    errors = one_error_line(err)
    assert rc == 2 and no_traceback(rc, err) and len(errors) == 1 and str(run) in err, err
    assert "step 1" not in out and not (tmp_path / "missing").exists()


# ---------------------------------------------------------------------------------------------- export


def test_export_never_deletes_what_it_did_not_create(finished: Path, tmp_path: Path) -> None:
    """`OUT.tmp/` and `OUT.old/` holding someone's files (the old staging and aside names): left as they
    were; a symlink at either name is not followed."""
    _, run = copy_of(finished, tmp_path)
    outside = Outside(tmp_path)
    out = tmp_path / "hf"
    for name in ("hf.tmp", "hf.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_bytes(SECRET)
    rc, _, err = in_process(cli.main, ["export", str(run), "--out", str(out)])
    assert rc == 0 and no_traceback(rc, err), err
    export_hf(run, out, overwrite=True)  # a second export over the first (the run's own hf folder does this)
    for name in ("hf.tmp", "hf.old"):
        assert (tmp_path / name / "mine.txt").read_bytes() == SECRET
        shutil.rmtree(tmp_path / name)
        (tmp_path / name).symlink_to(outside.folder, target_is_directory=True)
    export_hf(run, out, overwrite=True)
    assert outside.unchanged() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hf",
        "hf.old",
        "hf.tmp",
        "outside",
        "recipe.yaml",
        "run",
    ]


@pytest.mark.parametrize("inside", ["checkpoints/step_00000009", "abandoned/x", "abandoned"])
def test_export_refuses_an_out_inside_a_runs_managed_folders(
    finished: Path, tmp_path: Path, inside: str
) -> None:
    _, run = copy_of(finished, tmp_path)
    out = run / inside
    rc, _, err = in_process(cli.main, ["export", str(run), "--out", str(out)])
    errors = one_error_line(err)
    assert rc == 2 and no_traceback(rc, err) and len(errors) == 1 and "--out" in errors[0], err
    assert steps(run) == [2, 3] and not (run / "checkpoints" / "step_00000009").exists()
    assert not RunLayout(run).abandoned.exists()


def test_export_to_a_dangling_symlink_is_one_line(finished: Path, tmp_path: Path) -> None:
    _, run = copy_of(finished, tmp_path)
    out = tmp_path / "hf"
    out.symlink_to(tmp_path / "missing")
    rc, _, err = in_process(cli.main, ["export", str(run), "--out", str(out)])
    errors = one_error_line(err)
    assert rc == 2 and no_traceback(rc, err) and len(errors) == 1 and "--out" in errors[0], err
    assert not (tmp_path / "missing").exists() and out.is_symlink()
