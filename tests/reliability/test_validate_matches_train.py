"""`memtrain validate` finds every problem `memtrain train` would stop on before step 1, in one pass.

The same bad recipes go through both commands (in this process, tiny models): both must exit 2 without a
traceback, and every problem line of train's message must be in validate's.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtrain import cli

from fault_kit.scenarios import in_process
from helpers import REPO, tiny_recipe_dict

Case = Callable[[Path], tuple[dict[str, Any], list[str]]]  # tmp dir -> (recipe, extra arguments)
NO_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")


def _recipe(tmp: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw = tiny_recipe_dict(tmp, **sections)
    raw["model"]["config"]["vocab_size"] = 256  # the byte tokenizer's ids
    return raw


def _file(tmp: Path, name: str, content: bytes) -> str:
    (tmp / name).write_bytes(content)
    return str(tmp / name)


def _data(source: str, name: str, content: bytes) -> Case:
    return lambda tmp: (_recipe(tmp, data={"source": source, "path": _file(tmp, name, content)}), [])


def _deepspeed(user: Any, sharding: str = "zero2") -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], list[str]]:
        path = _file(tmp, "ds.json", json.dumps(user).encode())
        s = {"sharding": sharding, "sharding_backend": "deepspeed", "deepspeed_config": path}
        return _recipe(tmp, strategies=s), []

    return case


def _model(**fields: Any) -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], list[str]]:
        raw = _recipe(tmp)
        raw["model"]["config"].update(fields)
        return raw, []

    return case


def _output_dir(relative: str) -> Case:
    def case(tmp: Path) -> tuple[dict[str, Any], list[str]]:
        (tmp / "a-file").write_text("not a directory")
        return _recipe(tmp, run={"output_dir": str(tmp / relative)}), []

    return case


def _config_path(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    raw = _recipe(tmp)
    raw["model"] = {"config_path": _file(tmp, "config.json", b"\xff\xfe{}")}
    return raw, []


def _big_tokenizer(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    data = {"source": "jsonl", "path": str(REPO / "data/tiny_chat.jsonl"), "kind": "chat"}
    raw = tiny_recipe_dict(tmp, data={**data, "tokenizer": str(REPO / "data/tiny-sft-tokenizer")})
    return raw, []  # 320 tokens with its special ones; the model's vocabulary is 64


def _sparse_tokenizer(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    """A tokenizer of 320 tokens, one of whose ids is 400: its count fits a 384-id model, its ids do not."""
    source = REPO / "data/tiny-sft-tokenizer"
    target = tmp / "sparse-tokenizer"
    target.mkdir(exist_ok=True)
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    moved = next(token for token, index in vocab.items() if index == 100)
    vocab[moved] = 400
    (target / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    data = {"source": "jsonl", "path": str(REPO / "data/tiny_chat.jsonl"), "kind": "chat"}
    raw = tiny_recipe_dict(tmp, data={**data, "tokenizer": str(target)})
    raw["model"]["config"]["vocab_size"] = 384
    return raw, []


def _everything_at_once(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    raw = _recipe(tmp, train={"lrr": 1}, data={"source": "text", "path": str(tmp / "missing.txt")})
    raw["model"]["config"]["hidden_size"] = -4
    raw["run"]["output_dir"] = _file(tmp, "a-file", b"")
    return raw, []


def _missing_text(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    return _recipe(tmp, data={"source": "text", "path": str(tmp / "nowhere.txt")}), []


def _alias_bomb(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    """10 x 10 x 10 x 10 x 10 values in an override of model.config."""
    levels = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 5)]
    return _recipe(tmp), [f"model.config.rope_scaling=[{', '.join(levels)}]"]


def _trainer_file(tmp: Path) -> tuple[dict[str, Any], list[str]]:
    trainer = _file(tmp, "mine.py", b"x = '\xff'\n")
    return _recipe(tmp), ["--trainer", f"{trainer}:Mine"]


CASES: dict[str, Case] = {
    "text data.path missing": _missing_text,
    "text data not UTF-8": _data("text", "corpus.txt", b"fine\n\n\xff\xfe bad\n"),
    "jsonl lone surrogate": _data("jsonl", "docs.jsonl", b'{"text": "a"}\n' * 3 + b'{"text": "\\ud800"}\n'),
    "jsonl field missing past the first records": _data(
        "jsonl", "docs.jsonl", b'{"text": "a"}\n' * 20 + b'{"body": "b"}\n'
    ),
    "dataset csv not UTF-8": _data("dataset", "rows.csv", b"text\n\xff\xfe\n"),
    "model.config_path not UTF-8": _config_path,
    "kv heads do not divide": _model(num_key_value_heads=3),
    "attention heads do not divide": _model(num_attention_heads=3, num_key_value_heads=1),
    "tokenizer larger than the vocabulary": _big_tokenizer,
    "tokenizer ids past its token count": _sparse_tokenizer,
    "lora target matching no module": lambda tmp: (
        _recipe(tmp, adapters={"kind": "lora", "target_modules": ["q_proj", "vproj"]}),
        [],
    ),
    "output_dir is a file": _output_dir("a-file"),
    "output_dir under a file": _output_dir("a-file/run"),
    "memory.budget of 1 byte, pinned plan": lambda tmp: (_recipe(tmp, memory={"budget": 1}), []),
    "schema, model, data and directory problems at once": _everything_at_once,
    "alias bomb in an override": _alias_bomb,
    "--trainer file not UTF-8": _trainer_file,
    "huge enum value": lambda tmp: (_recipe(tmp), ["strategies.precision=" + "p" * 300_000]),
}
DEEPSPEED_CASES: dict[str, Case] = {
    "deepspeed optimizer section": _deepspeed({"optimizer": {"type": "Adam"}}),
    "deepspeed zero_optimization: 3": _deepspeed({"zero_optimization": 3}),
    "deepspeed stage contradicts": _deepspeed({"zero_optimization": {"stage": 3}}),
    "deepspeed bf16 contradicts": _deepspeed({"bf16": {"enabled": True}}),
}


def problems(err: str) -> set[str]:
    """The problem lines of a `RecipeError` message, or the one-line message of another error."""
    lines = {line[4:] for line in err.splitlines() if line.startswith("  - ")}
    if lines:
        return lines
    return {line.split("error: ", 1)[1] for line in err.splitlines() if "error: " in line}


def run(command: str, tmp: Path, case: Case) -> tuple[int | str, str]:
    raw, extra = case(tmp)
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    rc, _, err = in_process(cli.main, [command, str(path), *extra])
    return rc, err


@pytest.mark.parametrize(
    "name",
    [*CASES, *(pytest.param(n, marks=NO_DEEPSPEED) for n in DEEPSPEED_CASES)],
)
def test_validate_reports_every_problem_train_stops_on(tmp_path: Path, name: str) -> None:
    case = {**CASES, **DEEPSPEED_CASES}[name]
    found = {}
    for command in ("validate", "train"):
        rc, err = run(command, tmp_path, case)
        assert rc == 2, f"{command}: exit {rc}\n{err[-2000:]}"
        assert "Traceback" not in err, f"{command}: {err[-2000:]}"
        assert len(err) < 3000, f"{command}: a value was echoed in full"
        found[command] = problems(err)
    missing = found["train"] - found["validate"]
    assert not missing, f"train reported what validate did not: {missing}"
    assert not (tmp_path / "run").exists(), "validate or train wrote the run directory before failing"


def test_all_problems_come_in_one_pass(tmp_path: Path) -> None:
    rc, err = run("validate", tmp_path, _everything_at_once)
    assert rc == 2
    lines = problems(err)
    for key in ("train.lrr", "model.config.hidden_size", "data.path", "run.output_dir"):
        assert any(line.startswith(key) for line in lines), (key, lines)
