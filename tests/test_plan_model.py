"""`memtrain plan --model ID|DIR --gpu PROFILE [--world-size N] [--seq-len L] [--lora|--qlora] [--mode ...]
[--write-recipe FILE]`: a what-if without a recipe, on a machine that has downloaded nothing (the models
come from memtrain's shape cards). The recipe it builds plans as the shipped recipe it is modelled on; the
recipe it writes validates and plans the same; a wrong flag is one line naming it.

The hole: a what-if needed a recipe file and the model in the local cache (issue 42)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtrain.cli import main
from memtrain.plan import Plan

import hf_cache
from helpers import REPO, plan_commands

QWEN3_30B_A3B = 30.5e9  # parameters, Qwen3-30B-A3B's model card ("30.5B in total, 3.3B activated")
MOE_WHAT_IF = "memtrain plan --model Qwen/Qwen3-30B-A3B --gpu h100-80gb --world-size 8"
QLORA_WHAT_IF = "memtrain plan --model meta-llama/Llama-3.1-8B --gpu rtx4090-24gb --qlora --write-recipe"


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _plan(argv: list[str]) -> dict[str, Any]:
    rc, out, err = _run(["plan", *argv, "--json"])
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    doc: dict[str, Any] = json.loads(out)
    return doc


@pytest.fixture(autouse=True)
def _nothing_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_cache.use_cache(monkeypatch, tmp_path / "empty-hf")


def test_qlora_what_if_is_the_shipped_qlora_recipe(tmp_path: Path) -> None:
    """`--model meta-llama/Llama-3.1-8B --gpu rtx4090-24gb --qlora` writes the recipe it planned, which is
    recipes/llama3-8b-qlora-24gb.yaml's (4-bit base, adapters, batch, sequence length, strategies) for that
    model, and validates; its weights are a 4-bit base, not 15 GiB of bf16 (the shipped recipe's plan is
    checked against QLoRA's arithmetic in tests/pretrained/test_real_scale_recipe.py)."""
    written = tmp_path / "qlora.yaml"
    model = "meta-llama/Llama-3.1-8B"
    doc = _plan([*shlex.split(QLORA_WHAT_IF)[2:], str(written)])
    assert doc["model_states"]["weights"] < 6 * 2**30 and doc["predicted"]["peak"] <= doc["budget"]["usable"]
    raw = yaml.safe_load(written.read_text())
    shipped = yaml.safe_load((REPO / "recipes/llama3-8b-qlora-24gb.yaml").read_text())
    shipped["model"]["pretrained"] = shipped["data"]["tokenizer"] = model
    for section in ("model", "adapters", "batch", "train", "checkpoint", "strategies"):
        assert raw[section] == shipped[section], section
    assert {k: v for k, v in raw["data"].items() if k != "path"} == {
        k: v for k, v in shipped["data"].items() if k != "path"
    }
    assert written.read_text().startswith(f"# Written by `memtrain plan --model {model} --mode sft --qlora")
    rc, out, err = _run(["validate", str(written)])
    assert rc == 0 and "`train` needs its weights" in out, err


def test_the_readmes_model_commands_are_the_ones_this_file_plans() -> None:
    """The README's `plan --model` commands (its recipe plans run in tests/pretrained/) are this file's."""
    readme = [c for c in plan_commands([REPO / "README.md"]) if " --model " in c]
    assert readme, "README.md shows no `memtrain plan --model` command"
    for command in readme:
        assert re.sub(r"(--write-recipe) \S+", r"\1", command) in (MOE_WHAT_IF, QLORA_WHAT_IF), command


def test_moe_what_if_on_eight_h100(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-30B-A3B, full fine-tuning on 8 H100s: every expert trains, so the fp32 gradients are the whole
    model's over 8 ranks (within 0.5% of the published count)."""
    rc, out, err = _run(shlex.split(MOE_WHAT_IF)[1:])
    assert rc == 0, err[-3000:]
    assert out.startswith("memtrain plan: --model Qwen/Qwen3-30B-A3B (sft) on 8 ranks\n")
    assert "shapes from memtrain's card for Qwen/Qwen3-30B-A3B; download the model to train" in err
    chosen = next(line for line in out.splitlines() if line.startswith("  weights "))
    gradients = float(chosen.split("gradients ")[1].split(" GiB")[0]) * 2**30
    assert abs(gradients / (4 * QWEN3_30B_A3B / 8) - 1) < 0.005, chosen


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["recipes/default.yaml", "--model", "Qwen/Qwen3-8B"], "--model: give a recipe"),
        (["recipes/default.yaml", "--lora"], "--lora: only with --model"),
        (["recipes/default.yaml", "--seq-len", "512"], "--seq-len: only with --model"),
        (["--model", "Qwen/Qwen3-8B", "--seq-len", "0"], "--seq-len: must be at least 1"),
        (["--model", "someone/not-a-card"], "--model: 'someone/not-a-card' is not a local directory"),
        ([], "plan: give a recipe file, or --model"),
    ],
)
def test_a_wrong_flag_is_named(argv: list[str], said: str) -> None:
    rc, out, err = _run(["plan", *argv, "--gpu", "h100-80gb"])
    assert rc == 2 and out == "" and "Traceback" not in err
    assert said in err, err


def test_an_existing_recipe_is_not_overwritten(tmp_path: Path) -> None:
    kept = tmp_path / "mine.yaml"
    kept.write_text("run: {name: mine}\n")
    rc, _, err = _run(["plan", "--model", "Qwen/Qwen3-8B", "--gpu", "h100-80gb", "--write-recipe", str(kept)])
    assert rc == 2 and f"--write-recipe: {kept} exists" in err
    assert kept.read_text() == "run: {name: mine}\n"


def test_modes_and_adapters_shape_the_recipe() -> None:
    """What each mode trains on, and what the adapters change (read back as the recipe schema reads it)."""
    from memtrain.causal_lm.recipe import CausalLMRecipe
    from memtrain.commands import what_if

    dpo = CausalLMRecipe.from_dict(what_if.recipe(what_if.WhatIf("Qwen/Qwen3-8B", mode="dpo", world_size=8)))
    assert dpo.data.kind == "preference" and dpo.data.seq_len == 2048 and not dpo.data.packing
    lora = CausalLMRecipe.from_dict(what_if.recipe(what_if.WhatIf("Qwen/Qwen3-8B", "pretrain", "lora", 8192)))
    assert lora.data.kind == "text" and lora.data.seq_len == 8192 and lora.adapters.kind == "lora"
    assert lora.model.quantization == "none" and lora.strategies.sharding == "none"
    nodes = what_if.WhatIf("Qwen/Qwen3-8B", adapters="qlora", nodes=2)
    assert CausalLMRecipe.from_dict(what_if.recipe(nodes)).strategies.sharding == "auto", (
        "2 nodes: many ranks"
    )


def test_a_model_directory_with_its_config_alone(tmp_path: Path) -> None:
    """`--model DIR`: the written recipe names the directory by its absolute path, and plans from it, with
    an override given as with a recipe (and written with it)."""
    from helpers import TINY_LLAMA

    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny/config.json").write_text(json.dumps(TINY_LLAMA))
    written = tmp_path / "out/pretrain.yaml"
    written.parent.mkdir()
    argv = [
        "--model",
        str(tmp_path / "tiny"),
        "--mode",
        "pretrain",
        "--seq-len",
        "32",
        "--gpu-memory",
        "8GiB",
    ]
    doc = _plan(["batch.global_size=2", *argv, "--write-recipe", str(written)])
    assert doc["predicted"]["peak"] <= doc["budget"]["usable"]
    raw = yaml.safe_load(written.read_text())
    assert raw["model"]["pretrained"] == str((tmp_path / "tiny").resolve()) == raw["data"]["tokenizer"]
    assert (raw["data"]["kind"], raw["data"]["seq_len"], raw["batch"]["global_size"]) == ("text", 32, 2)
    plan = Plan.from_dict(doc["plan"])
    assert plan.micro_batch_size * plan.accumulation_steps == 2, "the override took"
