"""`memtrain export` of a LoRA run: merged into a plain Hugging Face model by default, or the adapters alone
in peft's format with `--adapters-only`.

Tolerance: the references are the adapted model the trainer trained (fp32, adapters unmerged). The merged
export computes (W + s B A) x where the trained model computes W x + s B (A x): the same sums in another
order, so logits agree to float rounding (measured: 7e-8); 1e-5 leaves room for that and nothing more (the
adapters move them by 0.18 after three steps at lr 1e-2). The adapter-only export, loaded by peft over the
run's base weights, runs the very same computation as the trainer (measured: exactly).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtrain.causal_lm.export import export_hf, load_model_state
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer, build_config
from memtrain.cli import main
from memtrain.errors import MemtrainError

from helpers import REPO, TINY_LLAMA, subprocess_env, tiny_recipe, tiny_recipe_dict

pytest.importorskip("peft")

LORA = {"kind": "lora", "r": 4, "alpha": 8}
TOLERANCE = 1e-5
TRAINED = 1e-3  # the adapters moved the logits at least this far from the base model's


@dataclass
class LoraRun:
    recipe: CausalLMRecipe
    run: Path
    logits: torch.Tensor  # the trained adapted model's logits on `_ids()`
    base_logits: torch.Tensor  # the same model with its adapters off (B A left out)


def _ids() -> torch.Tensor:
    return torch.randint(0, TINY_LLAMA["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(0))


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids(), use_cache=False).logits.float()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _checkpoint_state(run: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model state, in whichever layout it was written."""
    return load_model_state(sorted((run / "checkpoints").iterdir())[-1])


def _base_model(recipe: CausalLMRecipe, run: Path) -> nn.Module:
    """The plain model holding the run's base weights: the checkpoint's `base_layer` weights under their
    plain names, the adapters left out."""
    from transformers import AutoModelForCausalLM

    base = {
        name.replace(".base_layer.", "."): value
        for name, value in _checkpoint_state(run).items()
        if ".lora_" not in name
    }
    model = AutoModelForCausalLM.from_config(build_config(recipe))
    model.load_state_dict(base, strict=True)
    return model


def _train(recipe: CausalLMRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    trainer = CausalLMTrainer(recipe)
    trainer.fit()
    model = trainer.model
    assert model is not None
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "the run trained LoRA layers"
    logits = _logits(model)
    for layer in layers:
        layer.enable_adapters(False)
    return logits, _logits(model)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> LoraRun:
    tmp_path = tmp_path_factory.mktemp("lora")
    recipe = tiny_recipe(tmp_path, adapters=LORA, checkpoint={"at_end": True}, train={"steps": 3, "lr": 1e-2})
    logits, base_logits = _train(recipe)
    assert _max_diff(logits, base_logits) > TRAINED, "the adapters trained"
    return LoraRun(recipe, tmp_path / "run", logits, base_logits)


def test_merged_export_is_the_adapted_model(lora_run: LoraRun, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert any(".lora_A.default." in name for name in _checkpoint_state(lora_run.run))
    out = export_hf(lora_run.run, tmp_path / "merged")
    assert not (tmp_path / "merged.tmp").exists() and not (out / "adapter_config.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    names = list(loaded.state_dict())
    assert names and not [n for n in names if ".lora_" in n or ".base_layer." in n], "a plain model"
    assert not any(type(m).__module__.startswith("peft") for m in loaded.modules())
    assert _max_diff(_logits(loaded), lora_run.logits) <= TOLERANCE
    assert _max_diff(_logits(loaded), lora_run.base_logits) > TRAINED  # the adapters are in it


def test_adapters_only_export_loads_with_peft(
    lora_run: LoraRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "adapters"
    assert main(["export", str(lora_run.run), "--adapters-only", "--out", str(out)]) == 0
    assert "peft format" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["base_model_name_or_path"] is None  # the run built its model from a config
    tensors = load_file(out / "adapter_model.safetensors")
    pattern = re.compile(r"base_model\.model\.model\.layers\.\d+\.\w+\.\w+_proj\.lora_[AB]\.weight")
    assert tensors and all(pattern.fullmatch(name) for name in tensors), sorted(tensors)[:4]
    assert len(tensors) == 2 * 7 * TINY_LLAMA["num_hidden_layers"]  # A and B of every linear but lm_head

    base = _base_model(lora_run.recipe, lora_run.run)
    assert _max_diff(_logits(base), lora_run.base_logits) <= TOLERANCE  # the run's base weights
    adapted = PeftModel.from_pretrained(base, out)
    assert _max_diff(_logits(adapted), lora_run.logits) <= TOLERANCE


def test_pretrained_lora_run_both_exports(tmp_path: Path) -> None:
    """A LoRA fine-tune of a `model.pretrained` directory: the adapters name it as their base, and peft
    loads them over that very directory; the merged export keeps its generation config."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    base_dir = tmp_path / "base"
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(base_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7).save_pretrained(
        base_dir
    )
    recipe = tiny_recipe(
        tmp_path,
        model={"config": None, "pretrained": str(base_dir)},
        adapters=LORA,
        checkpoint={"at_end": True},
        train={"steps": 2, "lr": 1e-2},
    )
    logits, base_logits = _train(recipe)
    assert _max_diff(base_logits, _logits(AutoModelForCausalLM.from_pretrained(base_dir))) <= TOLERANCE

    adapters = export_hf(tmp_path / "run", tmp_path / "adapters", adapters_only=True)
    assert json.loads((adapters / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        base_dir
    )
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapters)
    assert _max_diff(_logits(adapted), logits) <= TOLERANCE

    merged = export_hf(tmp_path / "run", tmp_path / "merged")
    assert GenerationConfig.from_pretrained(merged).temperature == 0.7
    assert _max_diff(_logits(AutoModelForCausalLM.from_pretrained(merged)), logits) <= TOLERANCE


def test_bf16_mixed_base_is_read_stored_and_exported_in_bf16(tmp_path: Path) -> None:
    """Under bf16-mixed a pretrained base is read straight into bf16 (frozen parameters in the compute dtype)
    while the adapters, created on the meta device beside it, train in fp32; the merged export writes the
    checkpoint's dtype (the base's bf16), the adapters-only export the adapters' fp32. The hole: the frozen
    base was read, kept, checkpointed and exported in fp32, twice the bytes."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    base_dir = tmp_path / "base"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(base_dir)
    recipe = tiny_recipe(
        tmp_path,
        model={"config": None, "pretrained": str(base_dir)},
        adapters=LORA,
        checkpoint={"at_end": True},
        train={"steps": 2, "lr": 1e-2},
        strategies={"precision": "bf16-mixed"},
    )
    trainer = CausalLMTrainer(recipe)
    trainer.fit()
    assert trainer.model is not None
    dtypes = {name: p.dtype for name, p in trainer.model.named_parameters()}
    assert {d for name, d in dtypes.items() if ".lora_" in name} == {torch.float32}
    assert {d for name, d in dtypes.items() if ".lora_" not in name} == {torch.bfloat16}

    merged = export_hf(tmp_path / "run", tmp_path / "merged")
    written = [t for f in merged.glob("*.safetensors") for t in load_file(f).values()]
    assert written and {t.dtype for t in written} == {torch.bfloat16}
    adapters = export_hf(tmp_path / "run", tmp_path / "adapters", adapters_only=True)
    tensors = load_file(adapters / "adapter_model.safetensors")
    assert tensors and {t.dtype for t in tensors.values()} == {torch.float32}


def test_adapters_only_on_a_plain_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain: dict[str, Any] = {"checkpoint": {"at_end": True}, "train": {"steps": 1}}
    CausalLMTrainer(tiny_recipe(tmp_path, **plain)).fit()
    capsys.readouterr()
    out = tmp_path / "adapters"
    assert main(["export", str(tmp_path / "run"), "--adapters-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--adapters-only" in err and "trained no adapters" in err
    assert not out.exists() and not (tmp_path / "adapters.tmp").exists()
    with pytest.raises(MemtrainError, match="--adapters-only"):
        export_hf(tmp_path / "run", out, adapters_only=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_zero3_lora_run_exports_from_dcp(tmp_path: Path) -> None:
    """Two ranks under FSDP2 zero3 write the adapted model as DCP files; `output.export: hf` merges them at
    the end of the run, and the merged model computes what peft computes with the adapter-only export
    over the checkpoint's base weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    raw = tiny_recipe_dict(
        tmp_path,
        adapters=LORA,
        checkpoint={"at_end": True},
        train={"steps": 2, "lr": 1e-2},
        batch={"global_size": 8, "micro_size": 2},
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(raw))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "memtrain", "train", str(path), "strategies.sharding=zero3", "output.export=hf"]
    done = subprocess.run(
        command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    step = tmp_path / "run/checkpoints/step_00000002"
    assert (step / "dcp/.metadata").is_file() and not (step / "model.pt").exists()

    recipe = CausalLMRecipe.from_dict(raw)
    adapters = export_hf(tmp_path / "run", tmp_path / "adapters", adapters_only=True)
    adapted = PeftModel.from_pretrained(_base_model(recipe, tmp_path / "run"), adapters)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run/hf")
    assert _max_diff(_logits(merged), _logits(adapted)) <= TOLERANCE
    with adapted.disable_adapter():
        assert _max_diff(_logits(merged), _logits(adapted)) > TRAINED  # the adapters are merged in
