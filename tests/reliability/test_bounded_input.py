"""Bounded input: YAML alias and nesting bombs, oversized files and values, and undecodable bytes at the
paths a recipe names end as one line naming the key or file, exit 2, quickly and without a traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from memtrain import cli
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.errors import RecipeError

from fault_kit.scenarios import in_process
from helpers import REPO, TINY_LLAMA, tiny_recipe_dict

BAD_BYTES = b"\xff\xfe\x80 not utf-8\n"


def write(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def fails_clearly(argv: list[str], *expected: str) -> str:
    """`memtrain ARGV` exits 2 with one message containing every `expected`, no traceback."""
    rc, _, err = in_process(cli.main, argv)
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err
    for text in expected:
        assert text in err, (text, err[-2000:])
    return err


def alias_bomb(levels: int) -> str:
    """Anchors of 9 values, each level 9 aliases of the one below: 9**levels values in a few hundred bytes."""
    lines = ["bombs:", "  a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def recipe_text(tmp_path: Path, **sections: dict[str, Any]) -> str:
    return yaml.safe_dump(tiny_recipe_dict(tmp_path, **sections))


# ------------------------------------------------------------------------------------------- YAML


@pytest.mark.parametrize(
    "placement",
    ["run:\n  name: *a5\n", "train:\n  steps: *a5\n", "model:\n  config:\n    bomb: *a5\n"],
    ids=["string value", "number value", "inside model.config"],
)
def test_alias_bomb_is_refused_before_it_expands(tmp_path: Path, placement: str) -> None:
    """531,441 values from 300 bytes: refused by counting the node graph, in well under a second."""
    path = tmp_path / "bomb.yaml"
    path.write_text(recipe_text(tmp_path) + alias_bomb(6) + placement, encoding="utf-8")
    started = time.perf_counter()
    with pytest.raises(RecipeError, match="expands to more than 100,000 values"):
        CausalLMRecipe.load(path)
    assert time.perf_counter() - started < 1.0
    fails_clearly(["validate", str(path)], "100,000")


def test_alias_bomb_in_an_override_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "r.yaml", tiny_recipe_dict(tmp_path))
    anchors = ", ".join(
        ["&a0 [x, x, x, x, x, x, x, x, x]"]
        + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 6)]
    )
    err = fails_clearly(["validate", str(path), f"run.name=[{anchors}]"], "override run.name", "100,000")
    assert len(err) < 1000


def test_recursive_alias_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(tmp_path) + "extra: &loop [*loop]\n", encoding="utf-8")
    fails_clearly(["validate", str(path)], "extra.0: a YAML alias inside its own anchor")


def test_yaml_nested_past_the_limit_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text(recipe_text(tmp_path) + "data:\n  seq_len: " + "[" * 100 + "1" + "]" * 100 + "\n")
    fails_clearly(["validate", str(path)], "data.seq_len", "nested too deeply (more than 64 levels)")


def test_recipe_file_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(recipe_text(tmp_path) + f"run:\n  name: {'n' * 2**21}\n", encoding="utf-8")
    fails_clearly(["validate", str(path)], "over the limit of 1 MiB for a recipe")


# ------------------------------------------------------------------------------------ long values


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategies.precision=" + "p" * 500_000, "strategies.precision"),
        ("data.source=" + "s" * 500_000, "data.source"),
        ("run.name=" + "n" * 500_000, "run.name"),
        ("train." + "k" * 500_000 + "=1", "unknown key"),
        ("model.config.model_type=" + "m" * 500_000, "model.config.model_type"),
    ],
    ids=["registry name", "enum", "path component", "unknown key", "model type"],
)
def test_long_values_are_cut_in_messages(tmp_path: Path, override: str, key: str) -> None:
    path = write(tmp_path / "r.yaml", tiny_recipe_dict(tmp_path, run={"output_dir": None}))
    for command in ("validate", "train"):
        err = fails_clearly([command, str(path), override], key)
        assert len(err) < 2000, err[:300]


# ------------------------------------------------------------------------------------------- JSON


def model_from(tmp_path: Path, config: str | bytes) -> dict[str, Any]:
    file = tmp_path / "config.json"
    file.write_bytes(config if isinstance(config, bytes) else config.encode())
    raw = tiny_recipe_dict(tmp_path)
    raw["model"] = {"config_path": str(file)}
    return raw


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"a": ' * 100 + "1" + "}" * 100, "nested more than 64 levels deep"),
        ("[" * 100_000 + "]" * 100_000, "nested more than 64 levels deep"),
        (BAD_BYTES, "is not UTF-8 text (byte 0, line 1)"),
        ("[1, 2]", "must hold a JSON object"),
    ],
    ids=["nested 100", "nested 100000", "not UTF-8", "a list"],
)
def test_model_config_json_is_bounded(tmp_path: Path, config: str | bytes, expected: str) -> None:
    path = write(tmp_path / "r.yaml", model_from(tmp_path, config))
    fails_clearly(["validate", str(path)], "model.config_path", expected)


def test_json_over_the_size_limit_is_refused_unread(tmp_path: Path) -> None:
    raw = model_from(tmp_path, json.dumps({**TINY_LLAMA, "padding": "x" * (17 * 2**20)}))
    path = write(tmp_path / "r.yaml", raw)
    fails_clearly(["validate", str(path)], "model.config_path", "over the limit of 16 MiB")


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ([1, 2], "must hold a JSON object"),
        ({"zero_optimization": 3}, "zero_optimization must be a JSON object (got 3)"),
        ({"bf16": True}, "bf16 must be a JSON object (got True)"),
        ({"zero_optimization": {"reduce_bucket_size": "big"}}, "reduce_bucket_size must be a JSON number"),
        ({"gradient_clipping": [1]}, "gradient_clipping must be a JSON number"),
    ],
    ids=["a list", "zero_optimization: 3", "bf16: true", "bucket as a string", "clipping as a list"],
)
def test_deepspeed_config_of_the_wrong_shape(tmp_path: Path, user: Any, expected: str) -> None:
    (tmp_path / "ds.json").write_text(json.dumps(user))
    strategies = {
        "sharding": "zero2",
        "sharding_backend": "deepspeed",
        "deepspeed_config": str(tmp_path / "ds.json"),
    }
    path = write(tmp_path / "r.yaml", tiny_recipe_dict(tmp_path, strategies=strategies))
    fails_clearly(["validate", str(path)], "strategies.deepspeed_config", expected)


# ------------------------------------------------------------------------------------ undecodable


def data_recipe(tmp_path: Path, source: str, content: bytes, name: str) -> Path:
    file = tmp_path / name
    file.write_bytes(content)
    raw = tiny_recipe_dict(tmp_path, data={"source": source, "path": str(file), "synthetic": {}})
    raw["model"]["config"]["vocab_size"] = 256  # the byte tokenizer's ids
    return write(tmp_path / "r.yaml", raw)


@pytest.mark.parametrize("command", ["validate", "train"])
def test_text_data_not_utf8_names_the_line(tmp_path: Path, command: str) -> None:
    path = data_recipe(tmp_path, "text", b"first doc\n\nsecond\n" + BAD_BYTES, "corpus.txt")
    fails_clearly([command, str(path)], "data.path", "corpus.txt is not UTF-8 text", "line 4")


@pytest.mark.parametrize("command", ["validate", "train"])
def test_lone_surrogate_in_a_jsonl_record_names_the_line(tmp_path: Path, command: str) -> None:
    rows = b'{"text": "fine"}\n' * 20 + b'{"text": "bad \\ud800 here"}\n'
    path = data_recipe(tmp_path, "jsonl", rows, "docs.jsonl")
    fails_clearly([command, str(path)], "data.path", "docs.jsonl:21", "not valid Unicode")


@pytest.mark.parametrize("suffix", ["csv", "jsonl"])
def test_dataset_file_not_utf8_names_data_path(tmp_path: Path, suffix: str) -> None:
    path = data_recipe(tmp_path, "dataset", BAD_BYTES * 3, f"rows.{suffix}")
    fails_clearly(["validate", str(path)], "data.path", f"rows.{suffix}")


def test_trainer_file_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_bytes(b"x = '" + BAD_BYTES + b"'\n")
    path = write(tmp_path / "r.yaml", tiny_recipe_dict(tmp_path))
    for command in ("validate", "train"):
        fails_clearly(
            [command, str(path), "--trainer", f"{tmp_path / 'mine.py'}:Mine"], "--trainer", "line 1"
        )


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_pretrained_directory_files_not_utf8(tmp_path: Path, name: str) -> None:
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(model / "model.safetensors"))
    (model / name).write_bytes(BAD_BYTES)
    raw = tiny_recipe_dict(tmp_path)
    raw["model"] = {"pretrained": str(model)}
    fails_clearly(["validate", str(write(tmp_path / "r.yaml", raw))], "model.pretrained", "not UTF-8")


def test_gpu_profile_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "gpu.yaml").write_bytes(BAD_BYTES)
    path = REPO / "recipes" / "default.yaml"
    fails_clearly(["plan", str(path), "--gpu", str(tmp_path / "gpu.yaml")], "--gpu", "UTF-8")
