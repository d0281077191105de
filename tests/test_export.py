"""`memtrain export` / `output.export: hf`: every checkpoint format memtrain writes becomes a Hugging Face
directory that `AutoModelForCausalLM.from_pretrained` loads into the very model memtrain trained.

Tolerance: the export copies fp32 tensors bit for bit and both sides run the same transformers forward
on the same input, so logits agree to 1e-6 (measured: exactly). The references are the trained model
itself (one rank), the checkpoint as memtrain resumes it (FSDP2's DCP files loaded by a one-rank
trainer) and the module weights DeepSpeed resumes from (ZeRO-2 keeps whole fp32 module weights).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtrain import checkpoint as ckpt
from memtrain.causal_lm.export import export_hf
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer, build_config
from memtrain.cli import main
from memtrain.errors import MemtrainError
from memtrain.run import RunLayout

from helpers import REPO, TINY_LLAMA, run_two_ranks, tiny_recipe, tiny_recipe_dict

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
TIED_LLAMA = {**TINY_LLAMA, "tie_word_embeddings": True}
TWO_STEPS: dict[str, dict[str, Any]] = {
    "train": {"steps": 2},
    "checkpoint": {"at_end": True},
    "batch": {"global_size": 8, "micro_size": 2},
}
TOLERANCE = 1e-6


def _ids() -> torch.Tensor:
    return torch.randint(0, TINY_LLAMA["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(0))


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids(), use_cache=False).logits.float()


def _exported(out: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    return AutoModelForCausalLM.from_pretrained(out)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_replicated_round_trip_keeps_tied_weights(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, model={"config": copy.deepcopy(TIED_LLAMA)}, **TWO_STEPS)
    trainer = CausalLMTrainer(recipe)
    trainer.fit()
    assert trainer.model is not None
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    assert out == tmp_path / "hf" and not (tmp_path / "hf.tmp").exists()
    loaded = _exported(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    assert (out / "generation_config.json").is_file()
    assert _max_diff(_logits(loaded), _logits(trainer.model)) <= TOLERANCE
    assert _max_diff(_logits(loaded), _logits(CausalLMTrainer(recipe).build_model())) > 1e-3  # trained


def test_cli_export_step_and_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tiny_recipe(tmp_path, **{**TWO_STEPS, "checkpoint": {"every": 1, "keep": 3, "at_end": True}})
    CausalLMTrainer(recipe).fit()
    run = tmp_path / "run"
    assert main(["export", str(run), "--step", "1", "--out", str(tmp_path / "step1")]) == 0
    model = CausalLMTrainer(recipe).build_model()
    model.load_state_dict(torch.load(run / "checkpoints/step_00000001/model.pt", weights_only=True))
    assert _max_diff(_logits(_exported(tmp_path / "step1")), _logits(model)) <= TOLERANCE

    capsys.readouterr()
    assert main(["export", str(run), "--step", "7", "--out", str(tmp_path / "step7")]) == 2
    err = capsys.readouterr().err
    assert "--step" in err and "steps 1, 2" in err and not (tmp_path / "step7").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "step1")]) == 2  # not empty
    assert "--out" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run), "--out", str(tmp_path / "empty")]) == 0  # an empty one is fine
    assert (tmp_path / "empty/model.safetensors").is_file()
    fresh = tiny_recipe(tmp_path / "fresh", checkpoint={"at_end": False}, train={"steps": 1})
    CausalLMTrainer(fresh).fit()
    assert main(["export", str(tmp_path / "fresh/run"), "--out", str(tmp_path / "none")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_output_export_hf_through_train(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(tiny_recipe_dict(tmp_path, **TWO_STEPS)))
    assert main(["train", str(path), "output.export=hf"]) == 0
    run = tmp_path / "run"
    model = CausalLMTrainer(tiny_recipe(tmp_path)).build_model()
    model.load_state_dict(torch.load(run / "checkpoints/step_00000002/model.pt", weights_only=True))
    assert _max_diff(_logits(_exported(run / "hf")), _logits(model)) <= TOLERANCE
    # A resumed run that trains further exports again over its own run_dir/hf.
    assert main(["train", str(path), "output.export=hf", "train.steps=3", "--resume"]) == 0
    model.load_state_dict(torch.load(run / "checkpoints/step_00000003/model.pt", weights_only=True))
    assert _max_diff(_logits(_exported(run / "hf")), _logits(model)) <= TOLERANCE


def test_custom_trainer_run_is_refused_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    own = REPO / "examples/own_model"
    args = [
        "train",
        str(own / "recipe.yaml"),
        f"run.output_dir={tmp_path / 'run'}",
        "train.steps=1",
        "batch.micro_size=8",
        "strategies.checkpointing=none",
        "strategies.optimizer_states=fp32",
        "strategies.sharding=none",
        "output.progress=off",
    ]
    trainer = ["--trainer", f"{own / 'trainer.py'}:TinyTrainer"]
    assert main([*args, "output.export=hf", *trainer]) == 2  # refused before training
    assert "export needs a transformers model" in capsys.readouterr().err
    assert not (tmp_path / "run/checkpoints").exists()
    assert main([*args, *trainer]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    assert "export needs a transformers model" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def _tokenizer_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    wrapped.save_pretrained(path)
    return path


def test_pretrained_config_generation_config_and_tokenizer_files(tmp_path: Path) -> None:
    """A run of `model.pretrained` with a tokenizer directory: its config, its generation defaults and
    the tokenizer files (the copy the run keeps) go with the weights (the run directory is laid out by
    hand here)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    pretrained = tmp_path / "base"
    raw = dict(TIED_LLAMA)
    AutoConfig.for_model(raw.pop("model_type"), **raw).save_pretrained(pretrained)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7).save_pretrained(
        pretrained
    )
    tokenizer = _tokenizer_dir(tmp_path / "tok")
    raw_recipe = tiny_recipe_dict(tmp_path, data={"tokenizer": str(tokenizer)})
    raw_recipe["model"] = {"pretrained": str(pretrained)}
    recipe = CausalLMRecipe.from_dict(raw_recipe)
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.json").write_text(json.dumps(recipe.to_dict()))
    shutil.copytree(tokenizer, RunLayout(run).tokenizer_dir)  # what a run keeps of it when it starts
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pretrained))
    step = run / "checkpoints/step_00000004"
    step.mkdir(parents=True)
    ckpt.save_tensor_file(step / "model.pt", model.state_dict())
    (step / "meta.json").write_text(json.dumps({"step": 4}))

    out = export_hf(run, tmp_path / "hf", step=4)
    assert _max_diff(_logits(_exported(out)), _logits(model)) <= TOLERANCE
    assert GenerationConfig.from_pretrained(out).temperature == 0.7
    assert AutoTokenizer.from_pretrained(out)("w3 w5")["input_ids"] == [6, 8]

    del raw_recipe["model"]  # no model section at all: a custom trainer's run
    (run / "recipe.json").write_text(json.dumps(CausalLMRecipe.from_dict(raw_recipe).to_dict()))
    with pytest.raises(MemtrainError, match="export needs a transformers model"):
        export_hf(run, tmp_path / "hf2")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both two-rank runs of this module, in one torchrun launch (`cli_jobs.py`: a launch costs 6-8 s on
    the 2-core CI machine): FSDP2 zero3 with the export at the end of the run in `fsdp2/`, DeepSpeed zero2 in
    `deepspeed/` (when it is installed); each its own recipe and run directory."""
    tmp = tmp_path_factory.mktemp("two-ranks")
    runs = {
        "fsdp2": (
            {"model": {"config": copy.deepcopy(TIED_LLAMA)}},
            ["strategies.sharding=zero3", "output.export=hf"],
        ),
        "deepspeed": ({}, ["strategies.sharding=zero2", "strategies.sharding_backend=deepspeed"]),
    }
    jobs = []
    for name, (sections, overrides) in runs.items():
        if name == "deepspeed" and not HAVE_DEEPSPEED:
            continue
        recipe = tmp / name / "recipe.yaml"
        recipe.parent.mkdir()
        recipe.write_text(json.dumps(tiny_recipe_dict(tmp / name, **sections, **TWO_STEPS)))
        jobs.append(["train", str(recipe), *overrides])
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    run_two_ranks(str(REPO / "tests/cli_jobs.py"), str(tmp / "jobs.json"))
    return tmp


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_zero3_two_rank_checkpoint(two_rank_runs: Path, tmp_path: Path) -> None:
    run = two_rank_runs / "fsdp2/run"
    step = run / "checkpoints/step_00000002"
    assert (step / "dcp/.metadata").is_file() and not (step / "model.pt").exists()
    # The reference: the same checkpoint as memtrain resumes it, on one unsharded rank.
    reference = CausalLMTrainer(
        tiny_recipe(tmp_path / "ref", model={"config": copy.deepcopy(TIED_LLAMA)}, **TWO_STEPS)
    )
    reference.fit(resume=step)
    assert reference.model is not None
    exported = _exported(run / "hf")  # written by rank 0 at the end of the run
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    assert _max_diff(_logits(exported), _logits(reference.model)) <= TOLERANCE
    out = export_hf(run, tmp_path / "again")
    assert _max_diff(_logits(_exported(out)), _logits(reference.model)) <= TOLERANCE


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_zero2_two_rank_checkpoint(two_rank_runs: Path, tmp_path: Path) -> None:
    run = two_rank_runs / "deepspeed/run"
    step = run / "checkpoints/step_00000002"
    assert (step / "deepspeed").is_dir() and not (step / "model.pt").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    # The reference: the whole fp32 module weights DeepSpeed's ZeRO-2 resumes from (DeepSpeed pickles them).
    saved = torch.load(step / "deepspeed/state/mp_rank_00_model_states.pt", weights_only=False)["module"]
    model = CausalLMTrainer(tiny_recipe(tmp_path)).build_model()
    model.load_state_dict(saved)
    assert _max_diff(_logits(_exported(tmp_path / "hf")), _logits(model)) <= TOLERANCE
    assert _max_diff(_logits(model), _logits(CausalLMTrainer(tiny_recipe(tmp_path)).build_model())) > 1e-3


def test_config_of_the_run_is_the_recipe_config(tmp_path: Path) -> None:
    """Exported config.json says what the recipe built (the fields transformers loads the model by)."""
    recipe = tiny_recipe(tmp_path, model={"config": copy.deepcopy(TIED_LLAMA)}, **TWO_STEPS)
    CausalLMTrainer(recipe).fit()
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    saved = json.loads((out / "config.json").read_text())
    expected = build_config(recipe)
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert saved[field] == getattr(expected, field), field
    assert saved["model_type"] == "llama"
