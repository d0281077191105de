"""Faults inside one process: non-finite steps (skipped, counted, stop after K in a row with a
checkpoint), SIGTERM (checkpoint after the step in flight, clean stop, exact resume), and corrupt
checkpoints (clear error naming the file; fallback to the previous good one when asked)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from memtrain import checkpoint as tensor_files
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import TrainingStopped
from memtrain.run import checkpoints as ckpt
from memtrain.training.trainer import Batch

from helpers import tiny_recipe

SECTIONS = {"train": {"steps": 8, "lr": 1e-2, "max_bad_steps": 3}, "checkpoint": {"every": 2, "keep": 3}}


class Poisoned(CausalLMTrainer):
    """The loss is NaN on the chosen 0-based steps."""

    bad_steps: set[int] = set()

    def train_step(self, step: int) -> dict:
        self.now = step
        return super().train_step(step)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, count = super().loss(model, batch)
        return (loss_sum * float("nan") if self.now in self.bad_steps else loss_sum), count


def test_nan_steps_are_skipped_and_counted(tmp_path: Path) -> None:
    trainer = Poisoned(tiny_recipe(tmp_path, **SECTIONS))
    trainer.bad_steps = {2, 5}
    trainer.setup()
    snapshots = {}
    for step in range(8):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        row = trainer.train_step(step)
        snapshots[step] = (
            row["skipped"],
            all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)),
        )
    assert [s for s, (skipped, _) in snapshots.items() if skipped] == [2, 5]
    assert all(unchanged for skipped, unchanged in snapshots.values() if skipped), "parameters untouched"
    assert trainer.skipped_steps == 2


def test_k_consecutive_bad_steps_stop_with_a_checkpoint(tmp_path: Path) -> None:
    trainer = Poisoned(tiny_recipe(tmp_path, **SECTIONS))
    trainer.bad_steps = {3, 4, 5, 6, 7}
    with pytest.raises(TrainingStopped, match="3 steps in a row"):
        trainer.fit()
    assert ckpt.find_checkpoint(trainer.run.layout.checkpoints).step == 6  # stopped after the 3rd bad step


class SigtermAt(CausalLMTrainer):
    """Sends itself SIGTERM in the middle of step index 4 (as a scheduler would)."""

    def train_step(self, step: int) -> dict:
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().train_step(step)


def test_sigterm_checkpoints_the_step_in_flight_and_resume_is_exact(tmp_path: Path) -> None:
    sections = {**SECTIONS, "checkpoint": {"every": 0, "keep": 3}}
    straight = CausalLMTrainer(tiny_recipe(tmp_path / "a", **sections)).fit()
    first = SigtermAt(tiny_recipe(tmp_path / "b", **sections)).fit()
    assert first.preempted and first.steps_done == 5
    assert ckpt.find_checkpoint(tmp_path / "b/run/checkpoints").step == 5
    rest = CausalLMTrainer(tiny_recipe(tmp_path / "b", **sections)).fit(resume=True)
    assert first.losses + rest.losses == straight.losses
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler is removed after fit()"


def _corrupt(path: Path, how: str) -> None:
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:64])
    elif how == "wrong shapes":
        state = torch.load(path, weights_only=True)
        name = next(iter(state))
        state[name] = torch.zeros(3, 3)
        torch.save(state, path)


@pytest.mark.parametrize("how", ["truncated", "wrong shapes"])
def test_corrupt_checkpoint_error_names_the_file_and_falls_back(tmp_path: Path, how: str) -> None:
    CausalLMTrainer(tiny_recipe(tmp_path, **SECTIONS)).fit()
    newest = ckpt.find_checkpoint(tmp_path / "run/checkpoints")
    _corrupt(newest.path / "model.pt", how)
    longer = {**SECTIONS, "train": {**SECTIONS["train"], "steps": 10}}
    with pytest.raises(tensor_files.CheckpointError, match=str(newest.path / "model.pt")):
        CausalLMTrainer(tiny_recipe(tmp_path, **longer)).fit(resume=True)
    fallback = {**longer, "checkpoint": {**SECTIONS["checkpoint"], "fallback": True}}
    resumed = CausalLMTrainer(tiny_recipe(tmp_path, **fallback))
    result = resumed.fit(resume=True)
    assert newest.step == 6
    assert result.steps_done == 10 and len(result.losses) == 10 - 4  # resumed from step 4, the one before
