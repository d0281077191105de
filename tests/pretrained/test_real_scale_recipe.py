"""recipes/llama3-8b-chat-sft.yaml validates and plans here: its model and tokenizer are a hub id, staged in
a throw-away Hugging Face cache with the real config.json, a safetensors index (no weight files: neither
validation nor planning reads weights) and a small tokenizer with a chat template."""

from __future__ import annotations

import json
import re
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


@pytest.mark.usefixtures("staged_cache", "shared_traces")
def test_qlora_on_one_24gb_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The 8B QLoRA what-if on a 24 GB GPU: weights are the 4-bit arithmetic (docs/STRATEGIES.md) and a
    micro-batch and checkpointing that fit are chosen; the README's sample of this plan is what the command
    prints (the hole: nothing compared them, and the sample had drifted from the output)."""
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
    assert main(["plan", recipe, *data, "--gpu", "rtx4090-24gb"]) == 0  # the traces are shared: no retrace
    printed = capsys.readouterr().out.splitlines()
    sample = readme_sample("memtrain plan recipes/llama3-8b-qlora-24gb.yaml")
    assert sample[0].startswith("chosen: ") and len(sample) >= 5
    assert [line for line in sample if line not in printed] == [], "regenerate the README's sample"


def readme_sample(command: str) -> list[str]:
    """The lines of the README's output block that follows the code block holding `command`."""
    found = re.search(
        re.escape(command) + r".*?\n```\n```\n(.*?)\n```", (REPO / "README.md").read_text(), re.S
    )
    assert found is not None, f"README.md has no output block after {command!r}"
    return found.group(1).splitlines()


@pytest.mark.usefixtures("staged_cache")
def test_lora_on_eight_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    data = [f"data.path={REPO / 'data/tiny_chat.jsonl'}"]
    recipe = str(REPO / "recipes/llama3-8b-lora-8gpu.yaml")
    assert main(["plan", recipe, *data, "--gpu", "h100-80gb", "--world-size", "8"]) == 0
    table = capsys.readouterr().out
    assert "full fine-tuning would keep" in table and "more than lora" in table, table
