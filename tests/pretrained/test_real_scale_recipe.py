"""recipes/llama3-8b-chat-sft.yaml validates and plans here: its model and tokenizer are a hub id, staged in
a throw-away Hugging Face cache with the real config.json, a safetensors index (no weight files: neither
validation nor planning reads weights) and a small tokenizer with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.cli import main

from helpers import REPO
from hf_cache import HUB_ID, use_cache

RECIPE = str(REPO / "recipes/llama3-8b-chat-sft.yaml")


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
    use_cache(monkeypatch, tmp_path / "empty")
    assert main(["validate", RECIPE, f"data.path={REPO / 'data/tiny_chat.jsonl'}"]) == 2
    assert f"huggingface-cli download {HUB_ID}" in capsys.readouterr().err


@pytest.mark.usefixtures("staged_cache")
def test_qlora_on_one_24gb_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The 8B QLoRA what-if on a 24 GB GPU: weights are the 4-bit arithmetic (docs/STRATEGIES.md) and a
    micro-batch and checkpointing that fit are chosen."""
    from memtrain.strategies.quantization import QUANTIZATION

    data = [f"data.path={REPO / 'data/tiny_chat.jsonl'}"]
    recipe = str(REPO / "recipes/llama3-8b-qlora-24gb.yaml")
    assert main(["plan", recipe, *data, "--gpu", "rtx4090-24gb", "--json"]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    hidden, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    linears = [
        hidden * hidden,
        kv * hidden,
        kv * hidden,
        hidden * hidden,
        inter * hidden,
        inter * hidden,
        hidden * inter,
    ]
    rank = 16
    lora = sum(
        rank * (rows + cols)
        for rows, cols in (
            (hidden, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, hidden),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
        )
    )
    four_bit = QUANTIZATION.create("nf4").weight_bytes(linears * layers)
    other = 2 * vocab * hidden + (2 * layers + 1) * hidden  # embeddings, head, norms: fp32 (bf16-mixed)
    assert doc["model_states"]["weights"] == four_bit + 4 * other + 4 * layers * lora
    assert doc["model_states"]["gradients"] == 4 * layers * lora, "only the adapters have gradients"
    assert doc["predicted"]["peak"] <= doc["budget"]["usable"]
    assert doc["full_fine_tuning"]["weights"] > 4 * doc["model_states"]["weights"] / 2


@pytest.mark.usefixtures("staged_cache")
def test_lora_on_eight_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    data = [f"data.path={REPO / 'data/tiny_chat.jsonl'}"]
    recipe = str(REPO / "recipes/llama3-8b-lora-8gpu.yaml")
    assert main(["plan", recipe, *data, "--gpu", "h100-80gb", "--world-size", "8"]) == 0
    table = capsys.readouterr().out
    assert "full fine-tuning would keep" in table and "more than lora" in table, table


@pytest.mark.usefixtures("staged_cache")
def test_dpo_with_a_reference_copy_on_eight_h100(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """recipes/llama3-8b-dpo-8xh100.yaml validates and plans from the staged config with chat preference
    pairs; with `preference.reference=copy` every rank keeps the whole initial model in bf16 beside its
    shard of the policy, and the plan's weights count it (before, DPO did not exist; a planner without the
    copy's `frozen_bytes` would predict the policy's shard alone, 4 bytes x numel / 8)."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}],
            "chosen": [{"role": "assistant", "content": f"{2 * i}."}],
            "rejected": [{"role": "assistant", "content": f"{2 * i + 1}."}],
        }
        for i in range(8)
    ]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = str(REPO / "recipes/llama3-8b-dpo-8xh100.yaml")
    data = [f"data.path={pairs}"]
    assert main(["validate", recipe, *data]) == 0, capsys.readouterr().err
    assert "llama3-8b-dpo-8xh100.yaml: ok" in capsys.readouterr().out
    pinned = [
        "strategies.checkpointing=selective",
        "strategies.optimizer_states=8bit",
        "strategies.sharding=zero3",
    ]
    copy = [*data, *pinned, "preference.reference=copy"]
    assert main(["plan", recipe, *copy, "--gpu", "h100-80gb", "--world-size", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    numel = 8_030_261_248  # Llama-3.1-8B's parameters
    policy_shard = doc["model_states"]["weights"] - 2 * numel
    assert 0 < policy_shard <= 1.01 * 4 * numel / 8
    assert doc["predicted"]["peak"] <= doc["budget"]["usable"]
