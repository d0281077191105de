"""Checkpoints are atomic: a crash in the middle of a save leaves the previous checkpoint usable and
the half-written one invisible; only the last `keep` survive; loading never unpickles arbitrary objects."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain import checkpoint as tensor_files
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.run import checkpoints as ckpt

from helpers import tiny_recipe


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = CausalLMTrainer(tiny_recipe(tmp_path, train={"steps": 4}))
    trainer.setup()
    trainer.train_step(0)
    good = trainer.save_checkpoint(1)
    trainer.train_step(1)

    real_save = tensor_files.save_tensor_file
    calls = {"n": 0}

    def crash_on_second_file(path: Path, obj: object) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            path.write_bytes(b"half a file")
            raise KeyboardInterrupt("killed mid-save")
        real_save(path, obj)

    monkeypatch.setattr(tensor_files, "save_tensor_file", crash_on_second_file)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint(2)
    monkeypatch.setattr(tensor_files, "save_tensor_file", real_save)

    found = ckpt.find_checkpoint(trainer.run.layout.checkpoints)
    assert found.path == good and found.step == 1
    assert (trainer.run.layout.checkpoints / "step_00000002.tmp").is_dir()  # left behind, ignored

    resumed = CausalLMTrainer(tiny_recipe(tmp_path, train={"steps": 4}))
    resumed.setup()
    assert resumed._restore(True) == 1
    trainer.save_checkpoint(2)  # the next save clears the stale staging directory
    assert not (trainer.run.layout.checkpoints / "step_00000002.tmp").exists()


def test_keeps_only_last_k(tmp_path: Path) -> None:
    trainer = CausalLMTrainer(tiny_recipe(tmp_path, checkpoint={"every": 1, "keep": 2, "at_end": True}))
    trainer.fit()
    assert [c.step for c in ckpt.list_checkpoints(trainer.run.layout.checkpoints)] == [3, 4]


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    trainer = CausalLMTrainer(tiny_recipe(tmp_path, checkpoint={"at_end": True}))
    trainer.fit()
    model_file = ckpt.find_checkpoint(trainer.run.layout.checkpoints).path / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.raises(tensor_files.CheckpointError, match="model.pt"):
        tensor_files.load_tensor_file(model_file)


class Payload:
    """Stands for any non-tensor object a malicious checkpoint could carry."""


def test_loading_refuses_arbitrary_pickles(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"x": Payload()}, path)
    with pytest.raises(tensor_files.CheckpointError, match="evil.pt"):
        tensor_files.load_tensor_file(path)
