"""Model directories and recipe contents as untrusted input: no code from a model or tokenizer directory
runs, no weights come from a pickle, the model trains in the plan's dtype whatever its config says, bad
config values are one line in `validate` and `train` alike, and a key given twice is refused. Each test
states the hole it closes and fails on the code before the fix."""

from __future__ import annotations

import ast
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_bounded_input import fails_clearly

from memtrain import cli
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer

from fault_kit.scenarios import in_process
from helpers import REPO, TINY_LLAMA, subprocess_env, tiny_recipe_dict

TOKENIZER = REPO / "data" / "tiny-sft-tokenizer"


def saved_llama(directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Llama saved by transformers (config.json and model.safetensors) in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA), dtype=dtype)
    model.save_pretrained(directory)
    return directory


def recipe(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    raw = tiny_recipe_dict(tmp_path, **sections)
    if "pretrained" in raw["model"]:
        del raw["model"]["config"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def memtrain_answering_yes(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`memtrain ARGV` in a child whose stdin answers "y" to transformers' "run the custom code?" prompt."""
    return subprocess.run(
        [sys.executable, "-m", "memtrain", *argv],
        input="y\ny\ny\n",
        capture_output=True,
        text=True,
        cwd=cwd,
        env=subprocess_env(),
        timeout=300,
    )


# ------------------------------------------------------------------------------------- remote code

_PLANTED = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizer


class PlantedConfig(LlamaConfig):
    model_type = "planted_llama"


class PlantedModel(LlamaForCausalLM):
    config_class = PlantedConfig


class PlantedTokenizer(PreTrainedTokenizer):
    pass
"""


def plant_code(directory: Path, marker: Path) -> None:
    """The directory's config names classes in its own Python file, which writes `marker` when imported."""
    (directory / "planted.py").write_text(_PLANTED.format(marker=str(marker)), encoding="utf-8")
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    config["model_type"] = "planted_llama"  # no class transformers has: it would ask to run the code
    config["auto_map"] = {
        "AutoConfig": "planted.PlantedConfig",
        "AutoModelForCausalLM": "planted.PlantedModel",
    }
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.mark.slow
def test_a_model_directory_with_auto_map_never_runs_its_code(tmp_path: Path) -> None:
    """Hole: `validate` and `train` handed config.json's auto_map to transformers, whose "Do you wish to run
    the custom code? [y/N]" ran the directory's Python file on a `y` from stdin."""
    model, marker = saved_llama(tmp_path / "model"), tmp_path / "ran"
    plant_code(model, marker)
    path = recipe(tmp_path, model={"pretrained": str(model)})
    for command in ("validate", "train"):
        done = memtrain_answering_yes(command, str(path), cwd=tmp_path)
        assert not marker.exists(), (command, done.stderr[-2000:])
        assert done.returncode == 2 and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
        assert "model.pretrained" in done.stderr and "auto_map" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_export_of_a_run_whose_model_directory_gained_auto_map_never_runs_its_code(tmp_path: Path) -> None:
    """Hole: `export` read the config of the run's recipe.json model.pretrained with AutoConfig, which
    prompted and ran the directory's code on a `y`."""
    model, marker = saved_llama(tmp_path / "model"), tmp_path / "ran"
    path = recipe(tmp_path, model={"pretrained": str(model)}, train={"steps": 1}, checkpoint={"at_end": True})
    rc, _, err = in_process(cli.main, ["train", str(path)])
    assert rc == 0, err[-2000:]
    plant_code(model, marker)
    done = memtrain_answering_yes(
        "export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), cwd=tmp_path
    )
    assert not marker.exists(), done.stderr[-2000:]
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "model.pretrained" in done.stderr and "auto_map" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_tokenizer_directory_naming_a_custom_class_never_runs_its_code(tmp_path: Path) -> None:
    """Hole: a data.tokenizer directory whose tokenizer_config.json maps AutoTokenizer to its own Python
    file: transformers prompted and ran it on a `y`."""
    tokenizer, marker = tmp_path / "tokenizer", tmp_path / "ran"
    tokenizer.mkdir()
    for file in TOKENIZER.iterdir():
        (tokenizer / file.name).write_bytes(file.read_bytes())
    (tokenizer / "planted.py").write_text(_PLANTED.format(marker=str(marker)), encoding="utf-8")
    settings_file = tokenizer / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text(encoding="utf-8")) if settings_file.is_file() else {}
    settings["tokenizer_class"] = "PlantedTokenizer"
    settings["auto_map"] = {"AutoTokenizer": ["planted.PlantedTokenizer", None]}
    settings_file.write_text(json.dumps(settings), encoding="utf-8")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"text": f"row {i} of text"}) + "\n" for i in range(64)), encoding="utf-8"
    )
    data = {"source": "jsonl", "path": str(rows), "tokenizer": str(tokenizer)}
    path = recipe(tmp_path, data=data, model={"config": {**TINY_LLAMA, "vocab_size": 320}})
    for command in ("validate", "train"):
        done = memtrain_answering_yes(command, str(path), cwd=tmp_path)
        assert not marker.exists(), (command, done.stderr[-2000:])
        assert done.returncode == 2 and "Traceback" not in done.stderr, (command, done.stderr[-2000:])
        assert "data.tokenizer" in done.stderr and "auto_map" in done.stderr, done.stderr[-2000:]


def test_an_inline_config_with_auto_map_is_refused_by_name(tmp_path: Path) -> None:
    """Hole: `model.config.auto_map` went into the config, and from_config would look for its classes."""
    path = recipe(tmp_path, model={"config": {**TINY_LLAMA, "auto_map": {"AutoModelForCausalLM": "x.Y"}}})
    for command in ("validate", "train"):
        fails_clearly([command, str(path)], "model.config.auto_map")


def _transformers_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls of `from_pretrained` / `from_config` (transformers' loaders) in a module."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("from_pretrained", "from_config")
    ]


def _keyword(call: ast.Call, name: str) -> Any:
    found = [k.value for k in call.keywords if k.arg == name]
    return found[0].value if found and isinstance(found[0], ast.Constant) else "absent"


def test_every_transformers_loader_memtrain_calls_refuses_remote_code() -> None:
    """Every AutoConfig / AutoTokenizer / AutoModel* loader call in memtrain passes trust_remote_code=False
    (GenerationConfig has no remote code); every torch.load passes weights_only=True, and nothing calls
    pickle.load."""
    offenders = []
    for file in sorted((REPO / "src" / "memtrain").rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        for call in _transformers_calls(tree):
            owner = ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else ""
            if owner != "GenerationConfig" and _keyword(call, "trust_remote_code") is not False:
                offenders.append(f"{file.name}:{call.lineno} {ast.unparse(call.func)}")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name == "torch.load" and _keyword(node, "weights_only") is not True:
                offenders.append(f"{file.name}:{node.lineno} torch.load")
            if name in ("pickle.load", "pickle.loads"):
                offenders.append(f"{file.name}:{node.lineno} {name}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------ pickles


class _Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "ran"))


def test_a_pickle_only_model_directory_is_refused_unread(tmp_path: Path) -> None:
    """A model directory with only pytorch_model.bin (a pickle) is refused by name in `validate` and
    `train`, and the pickle is never loaded (it would write a marker)."""
    model, marker = saved_llama(tmp_path / "model"), tmp_path / "ran"
    (model / "model.safetensors").unlink()
    with (model / "pytorch_model.bin").open("wb") as handle:
        pickle.dump({"model.embed_tokens.weight": _Planted(marker)}, handle)
    path = recipe(tmp_path, model={"pretrained": str(model)})
    for command in ("validate", "train"):
        fails_clearly([command, str(path)], "model.pretrained", "pytorch_model.bin", "safetensors")
        assert not marker.exists(), command


# ----------------------------------------------------------------------------- the plan's dtype


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("dtype_key", ["torch_dtype", "dtype"])
def test_a_bf16_hub_config_trains_in_the_plans_dtype(tmp_path: Path, precision: str, dtype_key: str) -> None:
    """Hole: a config.json with `torch_dtype: bfloat16` (most hub models) built the model in bf16 and nothing
    cast it back: an fp32 or bf16-mixed plan trained pure bf16, with half-size optimizer states."""
    model = saved_llama(tmp_path / "model", torch.bfloat16)
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    config[dtype_key] = "bfloat16"  # as hub configs spell it (older ones torch_dtype)
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    path = recipe(
        tmp_path,
        model={"pretrained": str(model)},
        train={"steps": 1},
        strategies={"precision": precision, "sharding": "none"},
    )
    trainer = CausalLMTrainer(CausalLMRecipe.load(str(path)))
    try:
        trainer.fit()
        plan = json.loads((tmp_path / "run" / "plan.json").read_text(encoding="utf-8"))
        assert precision in json.dumps(plan["plan"]), plan["plan"]
        assert trainer.model is not None and trainer.optimizer is not None
        stored = {p.dtype for p in trainer.model.parameters()}
        states = {
            v.dtype
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim()
        }
        assert stored == {torch.float32}, stored  # both precisions store fp32 parameters
        assert states == {torch.float32}, states
    finally:
        trainer.close()


# ------------------------------------------------------------------------------- config values

BAD_VALUES = [
    ({**TINY_LLAMA, "hidden_act": "gelux"}, "model.config.hidden_act"),
    (
        {**TINY_LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 6},
        "model.config.num_experts_per_tok",
    ),
    (
        {**TINY_LLAMA, "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": -3},
        "model.config.moe_intermediate_size",
    ),
    (
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 64}
        | {"activation_function": "gelux"},
        "model.config.activation_function",
    ),
]


@pytest.mark.parametrize(("config", "key"), BAD_VALUES, ids=[key for _, key in BAD_VALUES])
def test_a_bad_config_value_is_one_line_in_validate_and_train(
    tmp_path: Path, config: dict[str, Any], key: str
) -> None:
    """Hole: values transformers takes but cannot build (an unknown activation, a negative MoE size) or run
    (more experts per token than experts) passed `validate` and were a traceback in `train`."""
    path = recipe(tmp_path, model={"config": config})
    for command in ("validate", "train"):
        fails_clearly([command, str(path)], key)


def test_a_bad_value_in_a_pretrained_config_names_the_file_field(tmp_path: Path) -> None:
    model = saved_llama(tmp_path / "model")
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "gelux"}), encoding="utf-8")
    path = recipe(tmp_path, model={"pretrained": str(model)})
    for command in ("validate", "train"):
        fails_clearly([command, str(path)], "model.pretrained (its config.json hidden_act)", "gelux")


# -------------------------------------------------------------------------------- duplicate keys


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """Hole: YAML kept the last of two equal keys silently: a recipe that said two things trained one."""
    text = yaml.safe_dump(tiny_recipe_dict(tmp_path), sort_keys=False)
    text = text.replace("  lr: 0.01\n", "  lr: 0.01\n  warmup_steps: 2\n", 1)
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    lines = text.splitlines()
    first, second = (i + 1 for i, line in enumerate(lines) if line.strip().startswith("warmup_steps:"))
    for command in ("validate", "train"):
        fails_clearly([command, str(path)], "train.warmup_steps", f"line {first}", f"line {second}")
    assert not os.path.exists(tmp_path / "run")
