"""Run lineage (issue #15): a rollback truncates the run explicitly and a later `--resume auto` continues
the new lineage, even after a kill; a resume whose recipe changes the training needs
`--allow-recipe-change`; a checkpoint of another run forks into a new run directory."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from memtrain import cli
from memtrain.run import checkpoints as ckpt
from memtrain.training.metrics import read_metrics

from fault_kit.faults import Fault, Harness
from fault_kit.scenarios import (
    TINY_LLAMA,
    in_process,
    launch,
    recipe_dict,
    run_difference,
    train_cmd,
    write_recipe,
)
from helpers import Killed

SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},  # dropout: the RNG state matters
    "train": {"steps": 6, "warmup_steps": 2, "lr": 1e-2},
    "checkpoint": {"every": 1, "keep": 3, "at_end": True},
}
NEW_LR = "train.lr=0.001"


def train(recipe: Path, run: Path, *extra: str) -> tuple[int | str, str, str]:
    return in_process(cli.main, ["train", str(recipe), f"run.output_dir={run}", *extra, "--no-progress"])


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / ckpt.step_dir_name(step)


def steps(run: Path) -> list[int]:
    return [c.step for c in ckpt.list_checkpoints(run / "checkpoints")]


def records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "lineage.jsonl").read_text().splitlines()]


def trained(tmp_path: Path, **sections: dict[str, Any]) -> tuple[Path, Path]:
    """The recipe and its finished run `original`."""
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(tmp_path / "original", **sections))
    rc, out, err = train(recipe, tmp_path / "original")
    assert rc == 0, out + err
    return recipe, tmp_path / "original"


def rolled_back(recipe: Path, original: Path, run: Path, step: int) -> Path:
    """A copy of `original` rolled back to `step` with NEW_LR, uninterrupted: the new lineage."""
    shutil.copytree(original, run)
    rc, out, err = train(recipe, run, NEW_LR, "--resume", str(step_dir(run, step)), "--allow-recipe-change")
    assert rc == 0, out + err
    return run


def test_rollback_killed_after_rewriting_step_5_resumes_the_new_lineage(tmp_path: Path) -> None:
    """Repro 1: roll back to step 4 with another lr, SIGKILL just after step 5 is rewritten, then
    `--resume auto` must continue the new lineage: a metrics row for every step, bit-exact."""
    recipe, original = trained(tmp_path, **SECTIONS)
    reference = rolled_back(recipe, original, tmp_path / "reference", 4)
    run = tmp_path / "run"
    shutil.copytree(original, run)
    rollback = [NEW_LR, "--resume", str(step_dir(run, 4)), "--allow-recipe-change"]
    kill = Harness((Fault("kill", step=6, phase="forward"),))  # step 5 is saved; step 6 runs
    died = launch(train_cmd(recipe, f"run.output_dir={run}", *rollback, harness=kill))
    assert died.rc == -signal.SIGKILL, died.tail()
    assert "resuming from step 4 truncates this run: checkpoints of steps 5-6 moved to" in died.output
    assert steps(run) == [4, 5]

    rc, out, err = train(recipe, run, NEW_LR, "--resume", "auto")  # no flag: the new lineage's own lr

    assert rc == 0, out + err
    assert "at step 5" in out
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert run_difference(run, reference) is None
    truncate = next(r for r in records(run) if r["event"] == "truncate")
    assert [ckpt.read_meta(step_dir(run, s))["lineage"] for s in (5, 6)] == [truncate["lineage"]] * 2
    abandoned = sorted(p.name for p in (run / "abandoned").glob("*/step_*"))
    assert abandoned == ["step_00000005", "step_00000006"]  # moved, not deleted
    assert {row["step"] for row in read_metrics(next((run / "abandoned").glob("*/metrics.jsonl")))} == {5, 6}


def test_a_changed_lr_needs_the_flag_and_is_recorded(tmp_path: Path) -> None:
    recipe, run = trained(tmp_path, train={"steps": 2}, checkpoint={"every": 0, "keep": 2, "at_end": True})

    rc, _, err = train(recipe, run, "train.steps=3", NEW_LR, "--resume")
    assert rc == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert "train.lr (0.01 -> 0.001)" in err and "--allow-recipe-change" in err
    assert "train.steps" not in err and steps(run) == [2]

    rc, out, err = train(recipe, run, "train.steps=3", "--resume")  # train.steps may change freely
    assert rc == 0, out + err

    rc, out, err = train(recipe, run, "train.steps=4", NEW_LR, "--resume", "--allow-recipe-change")
    assert rc == 0, out + err
    assert records(run)[-1]["recipe_changes"]["train.lr"] == [0.01, 0.001]
    assert json.loads((run / "recipe.json").read_text())["train"]["lr"] == 0.001
    assert any(json.loads(p.read_text())["train"]["lr"] == 0.01 for p in run.glob("recipe.*.json"))

    meta = step_dir(run, 4) / "meta.json"  # a checkpoint of an older memtrain: its recipe is unknown
    old = {k: v for k, v in json.loads(meta.read_text()).items() if k not in ("recipe", "lineage", "parent")}
    meta.write_text(json.dumps(old))
    rc, out, err = train(recipe, run, "train.steps=5", "train.lr=0.002", "--resume")
    assert rc == 0, out + err


def test_a_rollback_killed_while_it_moves_checkpoints_is_finished_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sections = {**SECTIONS, "train": {**SECTIONS["train"], "steps": 4}, "checkpoint": {"every": 1, "keep": 4}}
    recipe, original = trained(tmp_path, **sections)
    reference = rolled_back(recipe, original, tmp_path / "reference", 2)
    run = tmp_path / "run"
    shutil.copytree(original, run)
    real_move = ckpt.move_dir

    def move_then_die(source: Path, target: Path) -> None:
        real_move(source, target)
        raise Killed(f"killed after moving {source.name}")

    monkeypatch.setattr(ckpt, "move_dir", move_then_die)
    rc, out, _ = train(recipe, run, NEW_LR, "--resume", str(step_dir(run, 2)), "--allow-recipe-change")
    assert "Killed" in str(rc)
    assert steps(run) == [1, 2, 3]  # step 4 moved; step 3 of the old lineage still listed
    monkeypatch.setattr(ckpt, "move_dir", real_move)

    rc, out, err = train(recipe, run, NEW_LR, "--resume", "auto")

    assert rc == 0, out + err
    assert "at step 2" in out
    assert run_difference(run, reference) is None
    moved = sorted(p.relative_to(run / "abandoned").parts[1] for p in (run / "abandoned").glob("*/step_*"))
    assert moved == ["step_00000003", "step_00000004"]


def test_a_checkpoint_of_another_run_forks_into_a_new_run_directory(tmp_path: Path) -> None:
    recipe, parent = trained(tmp_path, train={"steps": 2}, checkpoint={"every": 0, "keep": 2, "at_end": True})
    fork = tmp_path / "fork"

    rc, out, err = train(recipe, fork, "train.steps=3", "--resume", str(step_dir(parent, 2)))

    assert rc == 0, out + err
    assert "forks that run into" in out
    (record,) = [r for r in records(fork) if r["event"] == "fork"]
    assert record["parent"]["path"] == str(step_dir(parent, 2).resolve())
    assert record["parent"]["lineage"] == ckpt.read_meta(step_dir(parent, 2))["lineage"]
    assert (fork / "recipe.json").is_file() and (fork / "plan.json").is_file()
    assert ckpt.read_meta(step_dir(fork, 3))["lineage"] == record["lineage"]

    rc, _, err = train(recipe, fork, "train.steps=3", "--resume", str(step_dir(parent, 2)))
    assert rc == 2 and "already holds checkpoints" in err and "Traceback" not in err
