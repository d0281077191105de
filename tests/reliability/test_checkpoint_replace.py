"""A checkpoint directory is whole whatever dies when (issue #15): saving a step that already has a
checkpoint never leaves a half `step_*` directory, the staging and trash directories a kill leaves are
invisible to resume and export and are removed at the next start, and a full disk is a one-line error
that keeps the previous checkpoint."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain import checkpoint as tensor_files
from memtrain import cli
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.run import checkpoints as ckpt

from fault_kit.scenarios import in_process, recipe_dict, run_difference, write_recipe
from helpers import Killed, tiny_recipe

SECTIONS: dict[str, dict[str, Any]] = {"checkpoint": {"every": 1, "keep": 3, "at_end": True}}


def model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(step_dir / "model.pt", weights_only=True)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not ckpt.STEP_DIR.match(p.name))


@pytest.mark.parametrize("dies", ["before the new one is renamed in", "while the old one is deleted"])
def test_saving_a_step_again_leaves_the_whole_old_or_the_whole_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dies: str
) -> None:
    recipe = tiny_recipe(tmp_path, train={"steps": 2}, **SECTIONS)
    trainer = CausalLMTrainer(recipe)
    trainer.setup()
    for step in (1, 2):
        trainer.train_step(step - 1)
        final = trainer.save_checkpoint(step)
    old = model_state(final)
    trainer.train_step(2)  # other parameters, saved again as step 2
    new = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(source: Any, target: Any) -> None:
        if Path(target) == final and dies.startswith("before"):
            raise Killed("killed between the renames")
        real_replace(source, target)

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith(final.name) and dies.startswith("while"):
            (Path(path) / "model.pt").unlink(missing_ok=True)
            raise Killed("killed mid-delete")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(Killed):
        trainer.save_checkpoint(2)
    monkeypatch.undo()

    resumed = CausalLMTrainer(recipe).fit(resume=True)
    assert resumed.steps_done == 2 and resumed.losses == []  # the next start resumes a whole step 2
    assert same(model_state(final), old if dies.startswith("before") else new)
    assert leftovers(final.parent) == []


def test_a_kill_in_the_last_prune_leaves_nothing_behind_after_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = tiny_recipe(tmp_path, train={"steps": 2}, checkpoint={"every": 1, "keep": 1, "at_end": True})
    root = tmp_path / "run" / "checkpoints"
    real_rmtree = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == "step_00000001.tmp":  # the pruned step 1, renamed out of the listing
            (Path(path) / "model.pt").unlink()
            raise Killed("killed mid-prune")
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with pytest.raises(Killed):
        CausalLMTrainer(recipe).fit()  # dies pruning step 1 after the final save of step 2
    monkeypatch.undo()
    shutil.copytree(root / "step_00000002", root / "step_00000002.old.tmp")  # a stale replace's trash
    assert leftovers(root) == ["step_00000001.tmp", "step_00000002.old.tmp"]

    rc, out, err = in_process(cli.main, ["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")])
    assert rc == 0 and "exported step 2" in out, err  # the stale directories are not checkpoints

    assert CausalLMTrainer(recipe).fit(resume=True).steps_done == 2  # nothing left to train
    assert leftovers(root) == [] and [c.step for c in ckpt.list_checkpoints(root)] == [2]


def test_a_full_disk_is_one_line_and_the_previous_checkpoint_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    sections = {"train": {"steps": 4, "warmup_steps": 2, "lr": 1e-2}, "checkpoint": {"every": 2, "keep": 2}}
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(run, **sections))
    args = ["train", str(recipe), "--no-progress"]
    straight = ["train", str(recipe), f"run.output_dir={tmp_path / 'straight'}", "--no-progress"]
    assert in_process(cli.main, straight)[0] == 0
    real_write = tensor_files.write_file

    def write_file(path: Path, write: Any) -> None:
        if path.name == "model.pt" and path.parent.name == "step_00000004.tmp":
            path.write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, write)

    monkeypatch.setattr(tensor_files, "write_file", write_file)
    rc, _, err = in_process(cli.main, args)
    monkeypatch.undo()

    errors = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and "Traceback" not in err and len(errors) == 1, err
    assert f"saving checkpoint step 4 in {run / 'checkpoints'}" in errors[0]
    assert (
        "a checkpoint needs about" in errors[0] and "the previous checkpoint (step 2) is intact" in errors[0]
    )
    assert "--resume" in errors[0]
    assert leftovers(run / "checkpoints") == []
    assert [c.step for c in ckpt.list_checkpoints(run / "checkpoints")] == [2]

    rc, out, err = in_process(cli.main, [*args, "--resume", "auto"])
    assert rc == 0 and "at step 2" in out, out + err
    assert run_difference(run, tmp_path / "straight") is None
