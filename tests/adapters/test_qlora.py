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
    assert abs(result.predicted.peak - measured.peak_bytes) / measured.peak_bytes < 0.02, (
        result.predicted,
        measured,
    )
    assert all(torch.isfinite(torch.tensor(fitted.losses)))


def test_quantised_weights_are_what_bitsandbytes_stores(tmp_path: Path) -> None:
    """The plan's weight bytes: the 4-bit tensors with their quantisation state, the rest unchanged."""
    trainer = CausalLMTrainer(_recipe(tmp_path, "nf4", {}))
    result = trainer.choose_plan()
    trainer.setup()
    assert trainer.model is not None and result.chosen is not None
    stored = 0
    seen: set[int] = set()
    for module in trainer.model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            tensors += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
            nested = getattr(state, "state2", None)
            tensors += [t for t in vars(nested).values() if isinstance(t, torch.Tensor)] if nested else []
        for tensor in tensors:
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                stored += tensor.untyped_storage().nbytes()
    buffers = sum(b.numel() * b.element_size() for b in trainer.model.buffers())
    assert result.chosen.states.stored[0] == stored - buffers


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
