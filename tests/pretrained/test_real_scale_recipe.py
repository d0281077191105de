"""recipes/llama3-8b-chat-sft.yaml validates and plans here: its model and tokenizer are a hub id, staged in
a throw-away Hugging Face cache with the real config.json, a safetensors index (no weight files: neither
validation nor planning reads weights) and a small tokenizer with a chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memtrain.cli import main

from helpers import REPO

RECIPE = str(REPO / "recipes/llama3-8b-chat-sft.yaml")
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


@pytest.fixture
def staged_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf"
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text("0123456789abcdef")
    (snapshot / "config.json").write_text(json.dumps(CONFIG))
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00004.safetensors"}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for file in (REPO / "data/tiny-sft-tokenizer").iterdir():
        shutil.copy(file, snapshot / file.name)
    _use_cache(monkeypatch, home)
    return snapshot


def _use_cache(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """huggingface_hub reads HF_HOME once, at import: point its constant at `home` too."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))


@pytest.mark.usefixtures("staged_cache")
def test_validates_and_plans_on_eight_h100(capsys: pytest.CaptureFixture[str]) -> None:
    data = [f"data.path={REPO / 'data/tiny_chat.jsonl'}"]
    assert main(["validate", RECIPE, *data]) == 0, capsys.readouterr().err
    assert "llama" in capsys.readouterr().out
    assert main(["plan", RECIPE, *data, "--gpu", "h100-80gb", "--world-size", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["precision"]["name"] == "bf16-mixed"
    numel = 8_030_261_248  # Llama-3.1-8B's parameters
    weights, predicted = doc["model_states"]["weights"], doc["predicted"]["peak"]
    assert weights < 4 * numel, "the weights are sharded over the 8 ranks"
    assert predicted <= doc["budget"]["usable"]


def test_not_downloaded_says_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _use_cache(monkeypatch, tmp_path / "empty")
    assert main(["validate", RECIPE, f"data.path={REPO / 'data/tiny_chat.jsonl'}"]) == 2
    assert f"huggingface-cli download {HUB_ID}" in capsys.readouterr().err
