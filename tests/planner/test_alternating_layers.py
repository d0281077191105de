"""Middle blocks built alike but set up as different kinds (Gemma-2's sliding-window and global attention
layers, alternating) are traced whole, not as a three-block clone (model_probe.py, `_settings`).

Why: each kind of layer reads its own attention mask, made once per forward and held by every
checkpointed block of that kind until the first of them runs its backward. The clone's middle block stands
for every middle block, but in Gemma-2's clone (sliding, global, global) it is the first global layer, the
one that frees the global mask: the walk freed that mask once per middle block. A later micro-step then
started a mask per middle block too low (family sweep, bf16-mixed + full checkpointing, micro 4 of 8:
-1.21%, the 64 KiB eager mask of 4 x 64 x 64 fp32; at 42 layers and 8k tokens, ~10 GiB per row).
"""

from __future__ import annotations

from pathlib import Path

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.planner.model_probe import ModelProbe

from helpers import tiny_recipe
from planner_cases import cpu_target, plan_on, scored_plan

KINDS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA2 = {
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "sliding_window": 32,  # shorter than the sequence: the two masks differ
    "layer_types": KINDS,
}
MAX_OVER, MAX_UNDER = 0.03, -0.005  # issue 14's goal


def _recipe(tmp_path: Path, micro: int | str, layer_types: list[str] = KINDS) -> CausalLMRecipe:
    return tiny_recipe(
        tmp_path,
        model={"config": {**GEMMA2, "layer_types": layer_types}, "attn_implementation": "eager"},
        data={"seq_len": 64, "eval_fraction": 0.0, "synthetic": {"num_samples": 24, "min_len": 64}},
        batch={"global_size": 8, "micro_size": micro},
        train={"steps": 3},
        memory={"track": True},
        strategies={"precision": "bf16-mixed", "checkpointing": "full", "optimizer_states": "fp32"},
    )


def test_layers_of_alternating_kinds_are_traced_whole(tmp_path: Path) -> None:
    alternating = ModelProbe(CausalLMTrainer(_recipe(tmp_path, 4)).model_spec())
    assert "middle blocks" in alternating.whole_model
    same = ModelProbe(CausalLMTrainer(_recipe(tmp_path, 4, ["sliding_attention"] * 4)).model_spec())
    assert same.whole_model == ""  # a layer index differs in every block, and says nothing of its kind


def test_a_later_micro_step_of_alternating_layers_is_predicted(tmp_path: Path, one_thread: None) -> None:
    recipe = _recipe(tmp_path, 4)
    planned = plan_on(
        _recipe(tmp_path, "auto"), cpu_target(), ModelProbe(CausalLMTrainer(recipe).model_spec())
    )
    predicted = scored_plan(planned, micro_batch_size=4).prediction.peak
    trainer = CausalLMTrainer(recipe)
    trainer.fit()
    measured = trainer.monitor.memory_reports[-1].peak_bytes
    error = (predicted - measured) / measured
    assert MAX_UNDER <= error <= MAX_OVER, (predicted, measured)
