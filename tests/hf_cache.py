"""A throw-away Hugging Face cache holding meta-llama/Llama-3.1-8B-Instruct's real config.json, a safetensors
index (no weight files: validation and planning read no weights) and a small tokenizer with a chat
template, so the real-scale fine-tuning recipes validate and plan here; or its config.json alone (what
`memtrain plan` and `validate` need before the weights are downloaded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import REPO

HUB_ID = "meta-llama/Llama-3.1-8B-Instruct"
CONFIG = {  # meta-llama/Llama-3.1-8B-Instruct's config.json
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config_only: bool = False) -> Path:
    """Stage the cache under `tmp_path` and point huggingface_hub at it; returns the snapshot directory.
    `config_only`: its config.json alone (what a what-if needs: no weights, no index, no tokenizer)."""
    home = tmp_path / "hf"
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text("0123456789abcdef")
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    use_cache(monkeypatch, home)
    if config_only:
        return snapshot
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00004.safetensors"}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for file in (REPO / "data/tiny-sft-tokenizer").iterdir():
        shutil.copy(file, snapshot / file.name)
    return snapshot


def use_cache(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """huggingface_hub reads HF_HOME and HF_HUB_OFFLINE once, at import: point its constants at `home`
    and offline too (nothing is fetched: a hub id the cache lacks fails at once)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
