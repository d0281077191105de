"""The family sweep's shrinker (scripts/family_sweep.py `tiny_config`) on the shapes that kept 18 families
from training (issue 14).

Why: the sweep can only plan a family whose tiny config builds and trains, and its general rules are what
make unseen families of the same shape work: a depth under another name than num_hidden_layers (GPT-Neo's
num_layers), sizes a default leaves None for the model to fail on (Ministral's head_dim, Nemotron's
num_key_value_heads, Cohere Compass's per-kind rope parameters), sub-configs of sizes (DBRX), per-layer
lists of sizes (Gemma-3n) and per-layer overrides of a heterogeneous config (Gemma-4), and a top-1 router
(Llama-4) that must stay top-1. Config-only: no model is built here (the sweep itself trains them).
"""

from __future__ import annotations

import importlib.util
import warnings
from types import ModuleType
from typing import Any

import pytest

from helpers import REPO


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    spec = importlib.util.spec_from_file_location("family_sweep", REPO / "scripts" / "family_sweep.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(tiny: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    fields = {k: v for k, v in tiny.items() if k != "model_type"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoConfig.for_model(tiny["model_type"], **fields)


def test_a_depth_under_another_name_cuts_its_per_layer_lists(sweep: ModuleType) -> None:
    tiny = sweep.tiny_config("gpt_neo")  # num_layers, not num_hidden_layers
    assert tiny["num_layers"] == 4
    assert _built(tiny).attention_layers == ["global", "local", "global", "local"]


@pytest.mark.parametrize(
    ("family", "field", "value"),
    [
        ("ministral", "head_dim", 16),  # hidden 64 / 4 heads; its model reads None as is
        ("hunyuan_v1_dense", "head_dim", 16),
        ("nemotron", "num_key_value_heads", 4),  # no grouped-query attention
        ("llama4_text", "num_experts_per_tok", 1),  # a top-1 router stays top-1
    ],
)
def test_sizes_a_default_leaves_unset_are_set(sweep: ModuleType, family: str, field: str, value: int) -> None:
    tiny = sweep.tiny_config(family)
    assert tiny[field] == value
    assert getattr(_built(tiny), field) == value


def test_empty_rope_parameters_get_one_entry_per_layer_kind(sweep: ModuleType) -> None:
    tiny = sweep.tiny_config("cohere_compass_text")
    assert set(tiny["rope_parameters"]) == set(_built(tiny).layer_types) == {"full_attention"}


def test_sub_configs_and_per_layer_sizes_shrink(sweep: ModuleType) -> None:
    dbrx = _built(sweep.tiny_config("dbrx"))
    assert (dbrx.ffn_config.hidden_size, dbrx.ffn_config.ffn_hidden_size) == (64, 128)
    assert dbrx.attn_config.rope_theta == 10000.0  # read by the model, absent from the default
    gemma3n = sweep.tiny_config("gemma3n_text")
    assert gemma3n["intermediate_size"] == [128] * 4


def test_per_layer_overrides_move_with_their_layers_and_scale(sweep: ModuleType) -> None:
    tiny = sweep.tiny_config("gemma4_text")  # full-attention layers: head_dim 512 over a global 256
    assert tiny["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert tiny["per_layer_config"] == {3: {"head_dim": 32}}
    config = _built(tiny)
    assert config.per_layer_config[3].head_dim == 32 and config.per_layer_config[0].head_dim == 16


def test_a_family_that_cannot_train_alone_is_skipped_with_why(sweep: ModuleType) -> None:
    outcome = sweep.run_family("gemma4_assistant", sweep.QUICK_PLANS)
    assert outcome["rows"] == [] and "shared_kv_states" in outcome["skipped"]
