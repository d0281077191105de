"""Configs with per-layer values pass memtrain's recipe checks (issue 14's family sweep found both).

Why: a model a user can build must never be refused by memtrain's own validation. Gemma-3n gives
`intermediate_size` as one size per layer, which the positive-size check refused; Gemma-4 is a
heterogeneous config whose per-layer fields (head_dim) refuse a global read with a RuntimeError, which
`hasattr` in the unknown-field check did not swallow. A wrong value and a misspelt field are still named.
"""

from __future__ import annotations

from pathlib import Path

from memtrain.causal_lm.trainer import model_problems

from helpers import tiny_recipe

GEMMA3N = {
    "model_type": "gemma3n_text",
    "hidden_size": 32,
    "intermediate_size": [64, 64, 64, 64],
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "vocab_size_per_layer_input": 64,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 64,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "num_kv_shared_layers": 2,
    "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
}

GEMMA4 = {
    "model_type": "gemma4_text",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 64,
    "vocab_size_per_layer_input": 64,
    "hidden_size_per_layer_input": 8,
    "max_position_embeddings": 64,
    "layer_types": ["sliding_attention", "full_attention"],
    "per_layer_config": {1: {"head_dim": 16}},
}


def _config_problems(tmp_path: Path, config: dict[str, object]) -> list[str]:
    recipe = tiny_recipe(tmp_path, model={"config": config, "attn_implementation": "eager"})
    return [p for p in model_problems(recipe) if p.startswith("model.")]


def test_a_per_layer_size_list_is_accepted_and_checked(tmp_path: Path) -> None:
    assert _config_problems(tmp_path, GEMMA3N) == []
    zero = {**GEMMA3N, "intermediate_size": [64, 0, 64, 64]}
    assert _config_problems(tmp_path, zero) == [
        "model.config.intermediate_size: must be a positive integer or a per-layer list of them "
        "(got [64, 0, 64, 64])"
    ]


def test_a_heterogeneous_configs_per_layer_fields_are_fields(tmp_path: Path) -> None:
    assert _config_problems(tmp_path, GEMMA4) == []
    misspelt = {**GEMMA4, "num_hiden_layers": 2}
    (problem,) = _config_problems(tmp_path, misspelt)
    assert problem.startswith("model.config.num_hiden_layers: not a field of the gemma4_text config")
