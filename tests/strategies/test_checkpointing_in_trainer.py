"""Activation checkpointing through the real Trainer and recipe keys: every mode trains bit-identically
to `none` in fp32 (losses and parameters after 3 steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer

from helpers import tiny_recipe


def _run(tmp_path: Path, mode: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    recipe = tiny_recipe(
        tmp_path / mode, train={"steps": 3}, strategies={"checkpointing": mode, "checkpointing_fraction": 0.5}
    )
    trainer = CausalLMTrainer(recipe)
    losses = trainer.fit().losses
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "fraction", "selective", "selective-op", "offload"])
def test_checkpointing_mode_is_bit_identical_in_the_trainer(tmp_path: Path, mode: str) -> None:
    ref_losses, ref_params = _run(tmp_path, "none")
    losses, params = _run(tmp_path, mode)
    assert losses == ref_losses
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name
