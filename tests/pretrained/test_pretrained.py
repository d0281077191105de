"""`model.pretrained`: a tiny Llama saved with `save_pretrained` (safetensors, single file and sharded index)
is fine-tuned: its weights are the loaded ones on one rank and, read shard by shard, under FSDP2 zero3 and
DeepSpeed zero3 on two ranks; the first step's loss is transformers' own on the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import main

import hf_cache
from helpers import TINY_LLAMA, run_two_ranks, tiny_recipe, tiny_recipe_dict

MARKED = 0.123  # embedding row 7 of the saved model: a random init would not have it


def save_tiny(directory: Path, shard: str | None = None, tied: bool = True) -> torch.nn.Module:
    config = AutoConfig.for_model(**{**TINY_LLAMA, "tie_word_embeddings": tied})
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[7].fill_(MARKED)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model


def _pretrained(tmp_path: Path, directory: Path, **sections: dict) -> object:  # type: ignore[type-arg]
    return tiny_recipe(tmp_path, model={"config": None, "pretrained": str(directory)}, **sections)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("tied", [True, False])
def test_first_step_loss_is_transformers_own(tmp_path: Path, layout: str, tied: bool) -> None:
    reference = save_tiny(tmp_path / "model", "20KB" if layout == "sharded" else None, tied)
    if layout == "sharded":
        assert (tmp_path / "model/model.safetensors.index.json").is_file()
    trainer = CausalLMTrainer(_pretrained(tmp_path, tmp_path / "model"))
    trainer.setup()
    model = trainer.model
    assert model is not None
    assert float(model.model.embed_tokens.weight[7, 0]) == pytest.approx(MARKED), "the loaded row, not random"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied, "ties as saved"
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    batch = trainer.split_batch(trainer.step_batch(0), 8)[0]
    loss_sum, tokens = trainer.loss(model, batch)
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"]).logits
    own = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    assert abs(float(loss_sum) / int(tokens) - float(own)) <= 1e-6
    assert trainer.fit().steps_done == 4


def test_bf16_master_loads_in_the_plans_dtype(tmp_path: Path) -> None:
    reference = save_tiny(tmp_path / "model")
    trainer = CausalLMTrainer(
        _pretrained(tmp_path, tmp_path / "model", strategies={"precision": "bf16-master"})
    )
    trainer.setup()
    assert trainer.model is not None
    weight = trainer.model.model.embed_tokens.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, reference.model.embed_tokens.weight.to(torch.bfloat16))


def test_planner_counts_the_checkpoints_parameters(tmp_path: Path) -> None:
    reference = save_tiny(tmp_path / "model")
    trainer = CausalLMTrainer(
        _pretrained(tmp_path, tmp_path / "model", batch={"global_size": 8, "micro_size": "auto"})
    )
    result = trainer.choose_plan()
    assert result.chosen is not None
    assert result.chosen.states.stored[0] == 4 * sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize(  # a config.json alone validates: tests/pretrained/test_real_scale_recipe.py
    ("contents", "message"),
    [
        ({"model.safetensors": ""}, "no config.json"),
        ({"config.json": "{}", "pytorch_model.bin": ""}, "pickles are not loaded"),
    ],
)
def test_bad_directory_is_caught_by_validate(
    tmp_path: Path, contents: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    for name, text in contents.items():
        (directory / name).write_text(text)
    raw = tiny_recipe_dict(tmp_path, model={"config": None, "pretrained": str(directory)})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "model.pretrained" in err and message in err


def test_hub_id_not_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hf_cache.use_cache(monkeypatch, tmp_path / "hf")  # offline: huggingface_hub read the variables at import
    raw = tiny_recipe_dict(tmp_path, model={"config": None, "pretrained": "nobody/no-such-model"})
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(recipe)]) == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_two_ranks_zero3_load_equals_the_checkpoint(tmp_path: Path, backend: str) -> None:
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    save_tiny(tmp_path / "model", "20KB")
    raw = tiny_recipe_dict(
        tmp_path,
        model={"config": None, "pretrained": str(tmp_path / "model")},
        strategies={"sharding": "zero3", "sharding_backend": backend},
        batch={"global_size": 8, "micro_size": 2},
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    out = tmp_path / "result.json"
    run_two_ranks(
        str(Path(__file__).with_name("rank_job.py")), str(recipe), str(out), str(tmp_path / "model")
    )
    result = json.loads(out.read_text())
    assert result["compared"] and all(result["compared"].values()), result
