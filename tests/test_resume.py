"""Resume is exact: 10 steps straight equal 5 steps + resume + 5 steps, loss by loss and bit by bit.

Dropout is switched on so that the RNG state in the checkpoint matters, and the learning-rate schedule
has warmup and decay so that the restored step matters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.checkpoint import CheckpointError
from memtrain.training.metrics import read_metrics

from helpers import TINY_LLAMA, tiny_recipe

SECTIONS = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},
    "train": {"steps": 10, "warmup_steps": 3, "lr": 1e-2},
    "checkpoint": {"every": 5, "keep": 2, "at_end": True},
    "batch": {"global_size": 8, "micro_size": 4},
}


class CrashesAtStep(CausalLMTrainer):
    """Dies like a killed job when step 7 starts (after the step-5 checkpoint, mid-way to the next)."""

    losses: list[float]

    def train_step(self, step: int) -> dict:
        if step == 6:
            raise KeyboardInterrupt("simulated kill")
        row = super().train_step(step)
        self.losses = [*getattr(self, "losses", []), row["loss"]][:5]
        return row


def _params(trainer: CausalLMTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_resume_reproduces_uninterrupted_run(tmp_path: Path) -> None:
    straight = CausalLMTrainer(tiny_recipe(tmp_path / "a", **SECTIONS))
    full = straight.fit()

    first = CrashesAtStep(tiny_recipe(tmp_path / "b", **SECTIONS))
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    assert (tmp_path / "b/run/checkpoints/step_00000005").is_dir()
    second = CausalLMTrainer(tiny_recipe(tmp_path / "b", **SECTIONS))
    part2 = second.fit(resume=True)

    assert first.losses + part2.losses == full.losses  # exact, not approximate
    for name, value in _params(straight).items():
        assert torch.equal(_params(second)[name], value), name
    logged = [row["loss"] for row in read_metrics(tmp_path / "b/run/metrics.jsonl")]
    assert logged == full.losses, "metrics.jsonl must read as one uninterrupted run"


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path: Path) -> None:
    CausalLMTrainer(tiny_recipe(tmp_path, **SECTIONS)).fit()
    with pytest.raises(CheckpointError, match="--resume"):
        CausalLMTrainer(tiny_recipe(tmp_path, **SECTIONS)).fit()


def test_resume_rejects_other_model(tmp_path: Path) -> None:
    CausalLMTrainer(tiny_recipe(tmp_path, **SECTIONS)).fit()
    other = {**SECTIONS, "model": {"config": {**TINY_LLAMA, "hidden_size": 48}}}
    with pytest.raises(CheckpointError, match="different model"):
        CausalLMTrainer(tiny_recipe(tmp_path, **other)).fit(resume=True)


def test_resume_without_checkpoint_names_the_directory(tmp_path: Path) -> None:
    trainer = CausalLMTrainer(tiny_recipe(tmp_path, **SECTIONS))
    with pytest.raises(CheckpointError, match="no checkpoint under"):
        trainer.fit(resume=True)


def test_resume_auto_starts_fresh_then_continues(tmp_path: Path) -> None:
    short = {**SECTIONS, "train": {**SECTIONS["train"], "steps": 5}}
    fresh = CausalLMTrainer(tiny_recipe(tmp_path, **short)).fit(resume="auto")
    assert fresh.steps_done == 5 and len(fresh.losses) == 5
    more = CausalLMTrainer(tiny_recipe(tmp_path, **{**SECTIONS, "train": {**SECTIONS["train"], "steps": 7}}))
    continued = more.fit(resume="auto")
    assert continued.steps_done == 7 and len(continued.losses) == 2
