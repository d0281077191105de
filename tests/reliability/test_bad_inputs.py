"""Inputs that used to reach a traceback or a silent wrong result: each test states the hole it closes,
and fails on the code before the fix."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_bounded_input import fails_clearly

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import PlanError, RecipeError

from fault_kit.input_bombs import run_bounded
from helpers import REPO, TINY_LLAMA, tiny_recipe, tiny_recipe_dict

TOKENIZER = str(REPO / "data" / "tiny-sft-tokenizer")


def recipe_file(tmp_path: Path, **sections: dict[str, Any]) -> str:
    raw = tiny_recipe_dict(tmp_path, **sections)
    raw["model"]["config"]["vocab_size"] = 320  # the shipped tokenizer's
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return str(path)


def test_jsonl_row_nested_100k_deep_is_one_line(tmp_path: Path) -> None:
    """Hole: `json.loads` raised RecursionError (a traceback) on a row nested 100,000 levels deep."""
    rows = tmp_path / "deep.jsonl"
    rows.write_text('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    path = recipe_file(tmp_path, data={"source": "jsonl", "path": str(rows), "tokenizer": TOKENIZER})
    for command in ("validate", "train"):
        fails_clearly([command, path], "data.path", "deep.jsonl:2", "nested more than 64 levels")


def test_datasets_json_nested_100k_deep_does_not_crash(tmp_path: Path) -> None:
    """Hole: the same row through data.source dataset crashed the process in pyarrow (SIGSEGV)."""
    rows = tmp_path / "deep.jsonl"
    rows.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")
    data = {"source": "dataset", "path": str(rows), "tokenizer": TOKENIZER, "streaming": True}
    rc, err, _ = run_bounded(["validate", recipe_file(tmp_path, data=data)], 120.0, 2**30)
    assert rc == 2 and "deep.jsonl:1 is nested more than 64 levels" in err, (rc, err[-1000:])


def test_200_mb_line_is_refused_without_reading_it(tmp_path: Path) -> None:
    """Hole: a 200 MB jsonl line was read whole, decoded and parsed; now refused at 64 MiB, one line.
    (The file is sparse: 200 MB long, almost nothing on disk.)"""
    rows = tmp_path / "long.jsonl"
    with rows.open("wb") as handle:
        handle.write(b'{"text": "')
        handle.seek(200 * 2**20)
        handle.write(b'"}\n')
    for source in ("jsonl", "dataset"):
        data = {"source": source, "path": str(rows), "tokenizer": TOKENIZER}
        rc, err, usage = run_bounded(["validate", recipe_file(tmp_path, data=data)], 120.0, 2**30)
        assert rc == 2 and "long.jsonl:1 is a line longer than 64 MiB" in err, (source, rc, err[-1000:])
        assert usage.grown < 600 * 2**20, usage


def relabelled(directory: Path) -> Path:
    """A tiny Llama's safetensors whose every F32 tensor is relabelled I32 in the header (same bytes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
    model.save_pretrained(directory)
    file = directory / "model.safetensors"
    data = file.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + size].replace(b'"F32"', b'"I32"')
    file.write_bytes(data[:8] + header + data[8 + size :])
    return file


def test_float_weights_stored_as_integers_are_refused(tmp_path: Path) -> None:
    """Hole: F32 tensors relabelled I32 loaded as integer values and trained to NaN with exit 0."""
    file = relabelled(tmp_path / "model")
    recipe = tiny_recipe(tmp_path, model={"config": None, "pretrained": str(tmp_path / "model")})
    with pytest.raises(RecipeError, match="stored as I32") as caught:
        CausalLMTrainer(recipe).setup()
    assert str(file) in str(caught.value) and "model.pretrained" in str(caught.value)


def test_trainer_file_that_exits_on_import_is_not_success(tmp_path: Path) -> None:
    """Hole: a --trainer file calling sys.exit(0) on import made `train` exit 0 having trained nothing."""
    path = recipe_file(tmp_path)
    for code in ("0", "3", "None"):
        script = tmp_path / f"exits_{code}.py"
        script.write_text(f"import sys\nsys.exit({code})\n", encoding="utf-8")
        fails_clearly(["train", path, "--trainer", f"{script}:T"], "--trainer", "sys.exit(")
    assert not (tmp_path / "run").exists()


def test_trainer_that_is_not_a_python_file(tmp_path: Path) -> None:
    """Hole: `--trainer x.yaml:T` (a path) failed an assertion in importlib's spec (a traceback)."""
    path = recipe_file(tmp_path)
    fails_clearly(["train", path, "--trainer", f"{path}:T"], "--trainer", "not a Python file")


@pytest.mark.parametrize(
    ("override", "key"), [("train.lr=1e300", "train.lr"), ("train.weight_decay=1e300", "train.weight_decay")]
)
def test_overflowing_learning_rate_is_refused_before_step_1(tmp_path: Path, override: str, key: str) -> None:
    """Hole: train.lr=1e300 passed validate and raised inside AdamW's step ("value cannot be converted
    to type float without overflow"), a traceback; lr * weight_decay likewise."""
    path = recipe_file(tmp_path)
    for command in ("validate", "train"):
        fails_clearly([command, path, override], key)
    assert not (tmp_path / "run").exists()


class EmptySecondStep(CausalLMTrainer):
    """Step 2's batch has no loss token (every label -100)."""

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        batch = super().step_batch(step)
        if step == 1:
            batch = {**batch, "labels": torch.full_like(batch["labels"], -100)}
        return batch


def test_step_without_loss_tokens_is_skipped_and_counted(tmp_path: Path) -> None:
    """Hole: a global step whose labels are all -100 logged loss 0.0 and stepped the optimizer (AdamW's
    moments moved the weights without any data)."""
    one = CausalLMTrainer(tiny_recipe(tmp_path / "one", train={"steps": 1}))
    one.fit()
    two = EmptySecondStep(tiny_recipe(tmp_path / "two", train={"steps": 2}))
    result = two.fit()
    assert one.model is not None and two.model is not None
    for (name, a), b in zip(one.model.state_dict().items(), two.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name} moved in the empty step"
    assert math.isnan(result.losses[1])
    assert result.summary["empty_steps"] == 1 and result.summary["skipped_steps"] == 1
    rows = [json.loads(line) for line in (tmp_path / "two/run/metrics.jsonl").read_text().splitlines()]
    assert rows[1]["loss"] is None and rows[1]["skipped"] is True and rows[1]["tokens"] == 0


def _resident() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_model_too_large_is_refused_from_its_shapes(tmp_path: Path) -> None:
    """Hole: a pinned plan was not checked, so a config too large for the machine was materialised
    (a 70B config allocated gigabytes) before anything said it did not fit. Here: 100M parameters
    (400 MB in fp32) against 64 MiB of free memory."""
    big = {**TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
    big.update({"num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192})
    trainer = CausalLMTrainer(tiny_recipe(tmp_path, model={"config": big}))
    before = _resident()
    with pytest.raises(PlanError, match=r"the model.s .* parameters are .* GiB of fp32 weights alone"):
        trainer.choose_plan(free_bytes=64 * 2**20)
        trainer.setup()
    assert _resident() - before < 200 * 2**20
