"""Planner fixes found by the family sweep (issue 14): parameters the step leaves without a gradient, blocks
nested in blocks, and families whose clone cannot be built.

Why each matters: a DSA indexer's projections (DeepSeek-V3.2, GLM-MoE-DSA) are read through `.detach()`,
so AdamW never allocates their gradients or states and the planner over-predicted by up to 17%; Mamba
names both its block and its mixer in `_no_split_modules`, which counted every layer twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.planner.model_probe import ModelProbe
from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.precision import Precision

from helpers import TINY_LLAMA, tiny_recipe
from planner_cases import cpu_target, plan_on, scored_plan

MODEL = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 5}


class DetachedTrainer(CausalLMTrainer):
    """A llama whose every block holds a parameter read only through `.detach()` and one never read (as a
    DSA indexer's are): trainable, yet without a gradient in any step."""

    def _from_config(self, config: Any, attn_implementation: str | None = None) -> nn.Module:
        model = super()._from_config(config, attn_implementation)
        for layer in model.model.layers:
            layer.unread = nn.Parameter(torch.zeros(96, 64))
            layer.detached = nn.Parameter(torch.zeros(64))
            layer.mlp.register_forward_hook(lambda m, _a, out: out + m.detached_of.detach())
            layer.mlp.detached_of = layer.detached  # type: ignore[assignment]
        return model


def _recipe(tmp_path: Path, precision: str) -> CausalLMRecipe:
    return tiny_recipe(
        tmp_path,
        model={"config": MODEL},
        data={"seq_len": 32, "eval_fraction": 0.0, "synthetic": {"num_samples": 24, "min_len": 0}},
        batch={"global_size": 8, "micro_size": 8},
        train={"steps": 3},
        memory={"track": True},
        strategies={"precision": precision, "checkpointing": "none", "optimizer_states": "fp32"},
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_parameters_without_gradient_get_no_state(tmp_path: Path, precision: str, one_thread: None) -> None:
    recipe = _recipe(tmp_path, precision)
    trainer = DetachedTrainer(recipe)
    probe = ModelProbe(trainer.model_spec())
    unread = {f"model.layers.{i}.{name}" for i in range(5) for name in ("unread", "detached")}
    assert probe.no_grad(Precision(), (1, 2)) == unread

    predicted = scored_plan(plan_on(recipe, cpu_target(), probe), micro_batch_size=8).prediction
    trainer.fit()
    measured = trainer.monitor.memory_reports[-1]
    assert predicted.maxima.optimizer_states == measured.component_peaks["optimizer_states"]
    assert abs(predicted.peak - measured.peak_bytes) / measured.peak_bytes < 0.005, (predicted, measured)


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mixer = _Mixer()


class _Nested(nn.Module):
    _no_split_modules = ["_Block", "_Mixer"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(4))


def test_blocks_nested_in_blocks_are_dropped() -> None:
    model = _Nested()
    assert discover_blocks(model) == list(model.layers)


def test_encoder_decoder_clone_cuts_the_decoder(tmp_path: Path) -> None:
    """ProphetNet's causal LM is its decoder, and its config refuses `num_hidden_layers` (the encoder's)."""
    config = {
        "model_type": "prophetnet",
        "hidden_size": 32,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "num_encoder_attention_heads": 4,
        "num_decoder_attention_heads": 4,
        "num_encoder_layers": 2,
        "num_decoder_layers": 5,
        "vocab_size": 64,
        "max_position_embeddings": 64,
    }
    recipe = tiny_recipe(tmp_path, model={"config": config, "attn_implementation": "eager"})
    trainer = CausalLMTrainer(recipe)
    clone = trainer.build_model_clone(3)
    assert len(trainer.blocks(clone)) == 3


class UntraceableCloneTrainer(CausalLMTrainer):
    """A model whose every reduced-depth clone fails in forward, on fake and real tensors alike (as
    Zamba2's does: its shared-block map names layers a clone cut away)."""

    def _from_config(self, config: Any, attn_implementation: str | None = None) -> nn.Module:
        model = super()._from_config(config, attn_implementation)
        if config.num_hidden_layers < MODEL["num_hidden_layers"]:
            model.model.layers[1].register_forward_pre_hook(_missing_layer)
        return model


def _missing_layer(*_args: object) -> None:
    raise KeyError(2)


def test_a_clone_that_cannot_run_traces_the_whole_model(tmp_path: Path, one_thread: None) -> None:
    recipe = _recipe(tmp_path, "fp32")
    probe = ModelProbe(UntraceableCloneTrainer(recipe).model_spec())
    reference = ModelProbe(CausalLMTrainer(recipe).model_spec())
    fitted = probe.trace(Precision(), NoCheckpointing(), (1, 2))
    assert fitted.depth == 5 and "clone cannot run" in probe.whole_model
    predicted = scored_plan(plan_on(recipe, cpu_target(), probe), micro_batch_size=8).prediction
    expected = scored_plan(plan_on(recipe, cpu_target(), reference), micro_batch_size=8).prediction
    assert predicted.peak == pytest.approx(expected.peak, rel=0.005)
