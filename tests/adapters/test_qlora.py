"""QLoRA on the CPU (bitsandbytes' 4-bit and 8-bit layers run here): a frozen quantised base with LoRA
adapters trains, and the planner predicts the tracker's peak (its trace runs `Quantization.stand_in`,
since bitsandbytes' layers cannot hold fake tensors) with the base's weights at their quantised bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError

from helpers import TINY_LLAMA, tiny_recipe

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("shared_traces")  # tests/conftest.py: alike jobs planned again

MODEL = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 256}
PLANS = {
    "nf4-fp32": ("nf4", {}),
    "nf4-bf16-mixed": ("nf4", {"precision": "bf16-mixed"}),
    "nf4-full": ("nf4", {"checkpointing": "full"}),
    "fp4-no-double-quant": ("fp4", {}),
    "int8": ("int8", {}),
}


def _recipe(tmp_path: Path, quantization: str, strategies: dict[str, Any], **model: Any):  # type: ignore[no-untyped-def]
    return tiny_recipe(
        tmp_path,
        model={"config": MODEL, "quantization": quantization, **model},
        adapters={"kind": "lora", "r": 4, "alpha": 8},
        memory={"track": True},
        batch={"global_size": 8, "micro_size": "auto"},
        data={"seq_len": 32, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}},
        strategies={"optimizer_states": "fp32", **strategies},
        train={"steps": 3, "lr": 1e-2},
    )


@pytest.mark.parametrize("case", PLANS)
def test_planned_peak_matches_the_tracker(tmp_path: Path, case: str) -> None:
    quantization, strategies = PLANS[case]
    extra = {"double_quant": False} if case == "fp4-no-double-quant" else {}
    trainer = CausalLMTrainer(_recipe(tmp_path, quantization, strategies, **extra))
    result = trainer.choose_plan()
    assert result.predicted is not None
    fitted = trainer.fit()
    assert trainer.model is not None
    quantised = [m for m in trainer.model.modules() if type(m).__module__.startswith("bitsandbytes")]
    assert quantised, "the base linears are bitsandbytes layers"
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    measured = trainer.monitor.memory_reports[-1]
    assert result.chosen is not None
    if quantization == "nf4":  # frozen bytes alike: the tracker's weights are the parameters alone
        assert measured.at_peak["weights"] == _stored_bytes(trainer.model, quant_states=False)
        assert result.chosen.prediction.at_peak.weights == _stored_bytes(trainer.model, quant_states=True)
    assert abs(result.predicted.peak - measured.peak_bytes) / measured.peak_bytes < 0.02, (
        result.predicted,
        measured,
    )
    assert all(torch.isfinite(torch.tensor(fitted.losses)))


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_quantised_weights_are_what_bitsandbytes_stores(tmp_path: Path, precision: str) -> None:
    """The plan's weight bytes: the 4-bit tensors with their quantisation state, the rest unchanged; under
    bf16-mixed the frozen embeddings, head and norms are stored in bf16 (the hole: they stayed fp32)."""
    trainer = CausalLMTrainer(_recipe(tmp_path, "nf4", {"precision": precision}))
    result = trainer.choose_plan()
    trainer.setup()
    assert trainer.model is not None and result.chosen is not None
    assert result.chosen.states.stored[0] == _stored_bytes(trainer.model, quant_states=True)
    floating = {n: p.dtype for n, p in trainer.model.named_parameters() if p.is_floating_point()}
    frozen = {dtype for n, dtype in floating.items() if ".lora_" not in n}
    assert frozen == {torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
    assert {dtype for n, dtype in floating.items() if ".lora_" in n} == {torch.float32}


def _stored_bytes(model: torch.nn.Module, quant_states: bool) -> int:
    """Bytes of `model`'s parameters (what the tracker counts as weights), with `quant_states` the tensors of
    their bitsandbytes quantisation states too (what the plan's weights count); each storage once."""
    stored = 0
    seen: set[int] = set()
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None and quant_states:
            tensors += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
            nested = getattr(state, "state2", None)
            tensors += [t for t in vars(nested).values() if isinstance(t, torch.Tensor)] if nested else []
        for tensor in tensors:
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                stored += tensor.untyped_storage().nbytes()
    return stored


def test_quantization_needs_adapters(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, model={"config": MODEL, "quantization": "nf4"})
    with pytest.raises(RecipeError, match="model.quantization: nf4 freezes the base model; add adapters"):
        CausalLMTrainer(recipe).choose_plan()


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_resume_and_merged_export(tmp_path: Path, quantization: str) -> None:
    """A QLoRA run resumed from its step-2 checkpoint ends as the run that went through (the frozen
    quantised base is rebuilt by setup, bitsandbytes cannot load it back); its merged export is a plain
    fp32 model with the dequantised base plus the adapters, with the QLoRA model's logits."""
    import shutil

    from transformers import AutoModelForCausalLM

    from memtrain.causal_lm.export import export_hf

    def recipe(root: Path):  # type: ignore[no-untyped-def]
        return tiny_recipe(
            root,
            model={"config": MODEL, "quantization": quantization},
            adapters={"kind": "lora", "r": 4, "alpha": 8},
            train={"steps": 4, "lr": 1e-2},
            checkpoint={"every": 2, "keep": 3, "at_end": True},
        )

    whole = CausalLMTrainer(recipe(tmp_path / "whole"))
    whole.fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    shutil.rmtree(tmp_path / "split/run/checkpoints/step_00000004")
    resumed = CausalLMTrainer(recipe(tmp_path / "split"))
    resumed.fit(resume=True)
    assert whole.model is not None and resumed.model is not None
    for (name, a), b in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name

    merged = AutoModelForCausalLM.from_pretrained(export_hf(tmp_path / "whole/run", tmp_path / "hf"))
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = whole.model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert float((expected - got).abs().max()) <= 1e-5
