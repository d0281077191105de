"""Recipes: every shipped file validates; mistakes are all reported at once, each naming its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import check_model_recipe
from memtrain.errors import RecipeError
from memtrain.recipe import apply_overrides

import hf_cache
from helpers import REPO, TINY_LLAMA, tiny_recipe_dict

ALL_RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


def test_there_are_recipes() -> None:
    assert len(ALL_RECIPES) >= 4


@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_recipe_validates(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every shipped recipe validates; the fine-tuning ones against a staged Hugging Face cache of their
    model (tests/hf_cache.py) and the shipped chat data (or preference pairs) in place of `data.path: <your
    data>`."""
    monkeypatch.chdir(REPO)
    hf_cache.stage(tmp_path, monkeypatch)
    recipe = CausalLMRecipe.load(path)
    if recipe.data.path is not None and not Path(recipe.data.path).exists():
        shipped = "data/tiny_pairs.jsonl" if recipe.data.kind == "preference" else "data/tiny_chat.jsonl"
        recipe = CausalLMRecipe.load(path, [f"data.path={shipped}"])
    check_model_recipe(recipe)


def _problems(raw: dict) -> list[str]:
    with pytest.raises(RecipeError) as info:
        CausalLMRecipe.from_dict(raw)
    return info.value.problems


def test_three_mistakes_three_messages(tmp_path: Path) -> None:
    raw = tiny_recipe_dict(tmp_path)
    raw["train"]["steps"] = "many"
    raw["train"]["lrr"] = 0.1
    raw["strategies"]["precision"] = "bf16-mix"
    problems = _problems(raw)
    assert len(problems) == 3, problems
    joined = "\n".join(problems)
    assert "train.steps" in joined
    assert 'train.lrr: unknown key (did you mean "lr"?)' in joined
    assert "strategies.precision" in joined and 'did you mean "bf16-mixed"' in joined


def test_unknown_section_gets_suggestion(tmp_path: Path) -> None:
    raw = tiny_recipe_dict(tmp_path)
    raw["trian"] = {"steps": 3}
    assert _problems(raw) == ['trian: unknown key (did you mean "train"?)']


def test_strategy_accepts_auto_name_or_list(tmp_path: Path) -> None:
    for value in ("auto", "bf16-mixed", ["fp32", "bf16-mixed"]):
        raw = tiny_recipe_dict(tmp_path)
        raw["strategies"]["precision"] = value
        assert CausalLMRecipe.from_dict(raw).strategies.precision == value
    raw["strategies"]["sharding"] = ["ddp", "zero9"]
    assert "strategies.sharding: 'zero9' is not one of" in _problems(raw)[0]


def test_overrides_parse_values_and_create_paths() -> None:
    raw = apply_overrides(
        {"train": {"steps": 5}},
        ["train.steps=20", "strategies.precision=bf16-mixed", "train.betas=[0.9, 0.99]"],
    )
    assert raw == {"train": {"steps": 20, "betas": [0.9, 0.99]}, "strategies": {"precision": "bf16-mixed"}}
    with pytest.raises(RecipeError, match="expected key.path=value"):
        apply_overrides({}, ["train.steps"])


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n  lr: [1, 2\n")
    with pytest.raises(RecipeError, match="malformed YAML at line"):
        CausalLMRecipe.load(path)


def test_model_config_mistakes(tmp_path: Path) -> None:
    raw = tiny_recipe_dict(tmp_path)
    raw["model"]["config"] = {**TINY_LLAMA, "model_type": "lama"}
    with pytest.raises(RecipeError, match=r'model.config.model_type: unknown .* \(did you mean "llama"\?\)'):
        check_model_recipe(CausalLMRecipe.from_dict(raw))
    raw["model"]["config"] = {**TINY_LLAMA, "num_hiden_layers": 4}
    with pytest.raises(
        RecipeError, match='model.config.num_hiden_layers: not a field .*did you mean "num_hidden_layers"'
    ):
        check_model_recipe(CausalLMRecipe.from_dict(raw))


def test_sequence_longer_than_model_maximum(tmp_path: Path) -> None:
    raw = tiny_recipe_dict(tmp_path, data={"seq_len": 128})
    with pytest.raises(RecipeError, match="data.seq_len: 128 exceeds the model's maximum of 64"):
        check_model_recipe(CausalLMRecipe.from_dict(raw))


def test_model_from_config_path(tmp_path: Path) -> None:
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, "architectures": ["LlamaForCausalLM"]}))
    raw = tiny_recipe_dict(tmp_path)
    raw["model"] = {"config_path": str(path)}
    check_model_recipe(CausalLMRecipe.from_dict(raw))
    raw["model"] = {"config_path": str(tmp_path / "missing.json")}
    with pytest.raises(RecipeError, match="model.config_path: file not found"):
        check_model_recipe(CausalLMRecipe.from_dict(raw))


def test_schema_lists_sections() -> None:
    schema = CausalLMRecipe.editor_schema()
    assert {"run", "model", "data", "batch", "train", "checkpoint", "strategies"} <= set(schema["properties"])


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (
            ["q_proj", "аll-linеаr"],
            "is not a module name (ASCII letters, digits, '_' and '.') (did you mean \"all-linear\"?)",
        ),
        (["all-linear", "q_proj"], "all-linear stands alone"),
        (["q_proj", "v proj"], "is not a module name"),
    ],
)
def test_adapter_targets_are_module_names(tmp_path: Path, targets: list[str], expected: str) -> None:
    """peft ignores a target that matches nothing when another matches: a look-alike letter (the fuzzer's
    Cyrillic 'а'), a space or all-linear inside a list would train without the adapters asked for."""
    raw = tiny_recipe_dict(tmp_path, adapters={"kind": "lora", "target_modules": targets})
    with pytest.raises(RecipeError) as caught:
        CausalLMRecipe.from_dict(raw)
    (problem,) = caught.value.problems
    assert problem.startswith("adapters.target_modules:") and expected in problem


def test_adapter_targets_accept_names_paths_and_all_linear(tmp_path: Path) -> None:
    def targets(value: object) -> object:
        raw = tiny_recipe_dict(tmp_path, adapters={"kind": "lora", "target_modules": value})
        return CausalLMRecipe.from_dict(raw).adapters.target_modules

    assert targets(["q_proj", "mlp.down_proj", "h.0.attn"]) == ["q_proj", "mlp.down_proj", "h.0.attn"]
    assert targets("all-linear") == targets(["all-linear"]) == "all-linear"
