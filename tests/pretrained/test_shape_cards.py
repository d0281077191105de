"""memtrain's shape cards (src/memtrain/causal_lm/shape_cards): each card builds on the meta device with the
parameter count its publisher gives, within 0.5%; a hub id neither local nor cached plans from its card,
said in one line, offline at once (one probe, not huggingface_hub's five retries with back-off); `train`
refuses a card-only model by name before anything is allocated.

The hole: a hub id not in the cache failed `plan` after 1 min 23 s of retries (issue 42), although the
shapes of these models are public facts."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.causal_lm import cards, pretrained
from memtrain.cli import main

import hf_cache
from helpers import tiny_recipe_dict

# card -> (parameters as published, where). The counts are the publishers' (model cards, papers, the
# Hugging Face model page's safetensors count), typed here as facts independent of the cards.
PUBLISHED = {
    "meta-llama--Llama-3.2-1B": (1.24e9, "HF model page meta-llama/Llama-3.2-1B: 1.24B params"),
    "meta-llama--Llama-3.2-3B": (3.21e9, "Llama 3.2 model card: 3.21B"),
    "meta-llama--Llama-3.1-8B": (8.03e9, "HF model page meta-llama/Llama-3.1-8B: 8.03B params"),
    "meta-llama--Llama-3.1-70B": (70.6e9, "HF model page meta-llama/Llama-3.1-70B: 70.6B params"),
    "meta-llama--Llama-3.1-405B": (406e9, "HF model page meta-llama/Llama-3.1-405B: 406B params"),
    "Qwen--Qwen2.5-0.5B": (0.494e9, "HF model page Qwen/Qwen2.5-0.5B: 494M params"),
    "Qwen--Qwen2.5-7B": (7.61e9, "Qwen2.5-7B model card: Number of Parameters 7.61B"),
    "Qwen--Qwen2.5-72B": (72.7e9, "Qwen2.5-72B model card: Number of Parameters 72.7B"),
    "Qwen--Qwen3-8B": (8.2e9, "Qwen3-8B model card: Number of Parameters 8.2B"),
    "Qwen--Qwen3-32B": (32.8e9, "Qwen3-32B model card: Number of Parameters 32.8B"),
    "Qwen--Qwen3-30B-A3B": (30.5e9, "Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated"),
    "mistralai--Mistral-7B-v0.3": (7.25e9, "HF model page mistralai/Mistral-7B-v0.3: 7.25B params"),
    "mistralai--Mixtral-8x7B-v0.1": (46.7e9, "Mistral AI, 'Mixtral of experts': 46.7B total parameters"),
    "google--gemma-2-2b": (2.61e9, "HF model page google/gemma-2-2b: 2.61B params"),
    "google--gemma-2-9b": (9.24e9, "HF model page google/gemma-2-9b: 9.24B params"),
    "google--gemma-2-27b": (27.2e9, "HF model page google/gemma-2-27b: 27.2B params"),
    "google--gemma-3-1b": (1.0e9, "HF model page google/gemma-3-1b-pt: 1,000M params"),
    "deepseek-ai--DeepSeek-V2-Lite": (15.7e9, "DeepSeek-V2-Lite model card: 15.7B total, 2.4B activated"),
    "deepseek-ai--DeepSeek-V3": (671e9, "DeepSeek-V3 technical report: 671B total (the MTP module aside)"),
    "openai--gpt-oss-20b": (20.91e9, "gpt-oss model card (OpenAI): 20.91B total parameters"),
    "openai--gpt-oss-120b": (116.83e9, "gpt-oss model card (OpenAI): 116.83B total parameters"),
    "microsoft--Phi-3-mini-4k-instruct": (3.82e9, "HF model page microsoft/Phi-3-mini-4k-instruct: 3.82B"),
    "microsoft--phi-4": (14.7e9, "HF model page microsoft/phi-4: 14.7B params"),
}
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def _empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face cache with nothing in it, offline (each test may go back online), and the one line
    said again in each test."""
    hf_cache.use_cache(monkeypatch, tmp_path / "empty-hf")
    monkeypatch.setattr(cards, "_announced", set())


def test_the_catalogue_holds_twenty_models_each_published() -> None:
    shipped = sorted(p.name for p in cards.CARDS_DIR.iterdir() if p.is_dir())
    assert len(shipped) >= 20 and sorted(PUBLISHED) == shipped
    named = {cards.card_directory(hub_id) for hub_id in cards.hub_ids()}
    assert named == {cards.CARDS_DIR / name for name in shipped}, "every card answers for a hub id"
    assert (
        cards.card_directory("META-LLAMA/llama-3.1-8b-instruct")
        == cards.CARDS_DIR / "meta-llama--Llama-3.1-8B"
    )


@pytest.mark.parametrize("card", sorted(PUBLISHED))
def test_each_card_has_its_published_parameter_count(card: str) -> None:
    config = AutoConfig.from_pretrained(str(cards.CARDS_DIR / card), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in model.parameters())
    published, source = PUBLISHED[card]
    assert abs(numel / published - 1) < 0.005, (card, f"{numel:,}", source)


def test_a_card_is_the_real_config() -> None:
    """Llama-3.1-8B-Instruct's card against its config.json as tests/hf_cache.py copies it."""
    card = json.loads((cards.CARDS_DIR / "meta-llama--Llama-3.1-8B/config.json").read_text())
    for key in (*SHAPE_KEYS, "num_key_value_heads", "rope_theta", "rope_scaling", "tie_word_embeddings"):
        assert card[key] == hf_cache.CONFIG[key], key


def test_offline_a_hub_id_plans_from_its_card_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    found = pretrained.resolve("meta-llama/Llama-3.1-8B-Instruct", fetch_config=True)
    pretrained.resolve("meta-llama/Llama-3.1-8B-Instruct", "data.tokenizer", fetch_config=True)
    assert found == cards.CARDS_DIR / "meta-llama--Llama-3.1-8B"
    assert time.monotonic() - started < 1
    said = capsys.readouterr().err.splitlines()
    assert said == [
        "[memtrain] shapes from memtrain's card for meta-llama/Llama-3.1-8B-Instruct; download the model to train"
    ]


def test_no_network_is_one_short_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Online mode, nothing listening at the hub's address: one probe answers, no retries (huggingface_hub
    alone retries five times, 1 + 2 + 4 + 8 + 8 s)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    pretrained._answers.cache_clear()
    started = time.monotonic()
    found = pretrained.resolve("Qwen/Qwen3-30B-A3B", fetch_config=True)
    assert found == cards.CARDS_DIR / "Qwen--Qwen3-30B-A3B"
    with pytest.raises(pretrained.RecipeError, match="model.pretrained: 'someone/not-a-card' is not"):
        pretrained.resolve("someone/not-a-card", fetch_config=True)
    assert time.monotonic() - started < pretrained.HUB_TIMEOUT_S + 1
    pretrained._answers.cache_clear()


def test_validate_a_recipe_whose_model_is_a_card() -> None:
    """The README's SFT recipe on a machine that has downloaded nothing."""
    rc, out, err = _run(["validate", "recipes/llama3-8b-chat-sft.yaml"])
    assert rc == 0, err
    assert "config.json only, `train` needs its weights" in out
    assert "shapes from memtrain's card for meta-llama/Llama-3.1-8B-Instruct" in err


def test_train_refuses_a_card_by_name_before_allocating(tmp_path: Path) -> None:
    raw = tiny_recipe_dict(tmp_path, model={"config": None, "pretrained": "meta-llama/Llama-3.2-1B"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    rc, _, err = _run(["train", str(tmp_path / "r.yaml")])
    assert rc == 2 and "Traceback" not in err
    assert "model.pretrained: 'meta-llama/Llama-3.2-1B' is not a local directory" in err, err
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in err
    assert not (tmp_path / "run").exists()
