"""`model.pretrained` reads transformers' own checkpoints of families whose parameters are not the saved
tensors: MoE layers built with fused experts but saved one tensor per expert (Mixtral's `experts.0.w1`,
Qwen2-MoE's and DeepSeek-V3's `experts.0.gate_proj`), and GPT-NeoX's head built as `lm_head` but saved as
`embed_out`. The loaded model is transformers' own `from_pretrained` load, tensor for tensor and logit for
logit, and trains a step; on two ranks under FSDP2 zero3 each rank's block of it is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from family_sweep import tiny_config
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer

from helpers import run_two_ranks, tiny_recipe_dict

FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_neox", "llama"]


def saved(directory: Path, family: str, shard: str | None = None) -> Any:
    """A tiny `family` model saved by `save_pretrained`, loaded back by transformers' `from_pretrained`."""
    fields = tiny_config(family)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def recipe_dict(tmp_path: Path, directory: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    raw = tiny_recipe_dict(tmp_path, **sections)
    raw["model"] = {"pretrained": str(directory), "attn_implementation": "eager"}
    raw["train"]["steps"] = 1
    return raw


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f == "mixtral" else f for f in FAMILIES]
)
def test_transformers_own_checkpoint_loads_as_from_pretrained_loads_it(tmp_path: Path, family: str) -> None:
    reference = saved(tmp_path / "model", family, "30KB")
    if family != "llama":  # the saved names are not the model's: the key mapping is what is tested
        from safetensors import safe_open

        index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text(encoding="utf-8"))
        assert set(index["weight_map"]) != {n for n, _ in reference.named_parameters()}
        for file in set(index["weight_map"].values()):
            with safe_open(str(tmp_path / "model" / file), "pt") as handle:
                assert handle.keys()
    raw = recipe_dict(tmp_path, tmp_path / "model")
    trainer = CausalLMTrainer(CausalLMRecipe.from_dict(raw))
    try:
        trainer.setup()
        model = trainer.model
        assert model is not None
        own = reference.state_dict()
        loaded = model.state_dict()
        for name, value in own.items():
            assert torch.equal(loaded[name], value), name
        batch = trainer.split_batch(trainer.step_batch(0), 8)[0]
        with torch.no_grad():
            ours = model(input_ids=batch["input_ids"], use_cache=False).logits
            theirs = reference(input_ids=batch["input_ids"], use_cache=False).logits
        assert torch.equal(ours, theirs), float((ours - theirs).abs().max())
        assert trainer.fit().steps_done == 1
    finally:
        trainer.close()


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_zero3_read_their_blocks_of_a_moe_checkpoint(tmp_path: Path) -> None:
    saved(tmp_path / "model", "mixtral", "30KB")
    raw = recipe_dict(
        tmp_path,
        tmp_path / "model",
        strategies={"sharding": "zero3", "sharding_backend": "fsdp2"},
        batch={"global_size": 8, "micro_size": 2},
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw), encoding="utf-8")
    out = tmp_path / "result.json"
    job = str(Path(__file__).with_name("rank_job.py"))
    run_two_ranks(job, str(recipe), str(out), str(tmp_path / "model"), "from_pretrained")
    result = json.loads(out.read_text())
    assert result["compared"] and all(result["compared"].values()), result
    assert any("experts.gate_up_proj" in name for name in result["compared"]), result


def _loads_as_transformers_does(family: str, directory: Path) -> str | None:
    """ "" when memtrain's `load_weights` fills a fresh `family` model with what transformers'
    `from_pretrained` loads from its tiny saved checkpoint; what differs otherwise. Families transformers
    cannot save and load back themselves are not memtrain's to read (None: not compared)."""
    from memtrain.causal_lm import pretrained

    try:
        reference = saved(directory, family).state_dict()
        fields = tiny_config(family)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    except Exception:  # noqa: BLE001 - a composite or multimodal family, or one transformers cannot reload
        return None
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    pretrained.load_weights(model, directory)
    loaded = model.state_dict()
    differ = [
        name
        for name, value in reference.items()
        if name in loaded
        and value.is_floating_point()
        and not torch.equal(loaded[name].to(value.dtype), value)
    ]
    return f"{family}: {differ[:3]}" if differ else ""


@pytest.mark.slow
def test_every_swept_family_loads_as_from_pretrained_loads_it(tmp_path: Path) -> None:
    """Every family the family sweep trains (scripts/family_sweep.py), saved by transformers, loads tensor
    for tensor as transformers' own `from_pretrained` loads it (175 of them with transformers 5.25)."""
    from family_sweep import families

    outcomes = {family: _loads_as_transformers_does(family, tmp_path / family) for family in families()}
    assert not [problem for problem in outcomes.values() if problem], outcomes
    compared = {family for family, problem in outcomes.items() if problem == ""}
    assert {"mixtral", "qwen2_moe", "deepseek_v3", "gpt_neox"} <= compared, sorted(compared)
    assert len(compared) >= 150, sorted(set(outcomes) - compared)


def test_a_rank_reads_only_its_own_experts(tmp_path: Path) -> None:
    """Under FSDP's dim-0 shards a rank keeps its rows of a stacked-experts parameter: only those experts'
    tensors are read, and they build exactly those rows of transformers' own parameter."""
    from safetensors import safe_open

    from memtrain.causal_lm import checkpoint_keys, pretrained

    reference = saved(tmp_path / "model", "mixtral")
    files = pretrained.weight_files(tmp_path / "model")
    names = dict(reference.named_parameters())
    found = checkpoint_keys.sources(reference, names, files)
    target = "model.layers.0.mlp.experts.gate_up_proj"
    source, whole = found[target], names[target]
    experts = whole.shape[0]
    assert experts >= 2 and source.stacks_experts(experts)
    read: list[str] = []

    def reader(key: str) -> torch.Tensor:
        read.append(key)
        with safe_open(str(files[key]), "pt") as handle:
            return handle.get_tensor(key)

    rows = slice(experts // 2, experts)
    built = source.convert(target, reader, reference, rows)
    assert torch.equal(built[target], whole.detach()[rows])
    assert len(read) == len(source.keys) - len(source.keys) // 2  # gate and up of the second half only
    assert all(int(key.split("experts.")[1].split(".")[0]) >= experts // 2 for key in read), read
