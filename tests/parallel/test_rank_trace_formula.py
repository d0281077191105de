"""The what-if's mesh formula (planner/mesh_cost.py: one rank's trace divided by the tensor-parallel
factors) against the rank trace of the same plan (planner/rank_trace.py: the trainer's own step as rank 0 of
torch's fake process group, itself checked against gloo runs in test_rank_trace.py), on FSDP 2 x TP 2 with
sequence parallelism, with full recompute and without.

The model is small but its activations dominate (hidden 128, 4 blocks, vocabulary 256, 8 rows of 512
tokens), as at a real-scale what-if (70B on 256 H100: the kept block inputs and the loss are 80% of the
rank's bytes). The hole (issue 39, 70B FSDP 32 x TP 8: 12.5% under the published peak): dividing the trace
by t misses what torch's tensor-parallel program holds whole on each rank, the sequence-parallel
all-gathered inputs the column-parallel linears save (two per block that keeps its activations, and the
recomputed one's) and the head's; measured here the formula was 7.3% under the rank trace with full
recompute and 5.6% under without. The vocabulary-parallel loss's extra fp32 logits
(`mesh_cost.tensor_parallel_extra`) are inside DTensor's handler, where the tracker does not see (its
dispatch mode is not active in a subclass's `__torch_dispatch__`): the formula holds them, the trace cannot,
so the bound over is wider than the rank trace's own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cluster import DEFAULT_CLUSTER
from memtrain.distributed import DistEnv
from memtrain.plan import mesh_of, pinned_plan
from memtrain.planner import here_target, plan_meshes
from memtrain.planner.rank_trace import RankTraces

from helpers import tiny_recipe_dict

UNDER, OVER = -0.005, 0.05
MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 448,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def _recipe(tmp_path: Path, checkpointing: str) -> CausalLMRecipe:
    raw = tiny_recipe_dict(
        tmp_path,
        model={"config": MODEL},
        data={"source": "synthetic", "seq_len": 512, "synthetic": {"num_samples": 32, "min_len": 512}},
        batch={"global_size": 16, "micro_size": 8},
        train={"steps": 2},
        strategies={
            "precision": "bf16-mixed",
            "checkpointing": checkpointing,
            "sharding": "zero3",
            "loss": "standard",
            "optimizer_states": "fp32",
            "mesh": {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
        },
    )
    return CausalLMRecipe.from_dict(raw)


@pytest.mark.parametrize("checkpointing", ["full", "none"])
def test_the_mesh_formula_holds_what_the_rank_trace_holds(tmp_path: Path, checkpointing: str) -> None:
    """The formula's busiest rank within [-0.5%, +5%] of the rank trace's peak (before: -7.3% / -5.6%)."""
    torch.set_num_threads(1)
    recipe = _recipe(tmp_path, checkpointing)
    spec = CausalLMTrainer(recipe).model_spec()
    found = plan_meshes(
        recipe,
        spec,
        here_target(recipe, 4),
        DEFAULT_CLUSTER,
        spec_at=lambda _seq: spec,
        progress=lambda _l: None,
    )
    best = found.chosen or found.best_misfit
    assert best is not None and best.mesh.tp == 2 and best.mesh.sequence_parallel
    mesh = mesh_of(recipe, 4)
    plan = pinned_plan(recipe, DistEnv(0, 4, 0, torch.device("cpu"), mesh=mesh)).replace(mesh=mesh)
    assert best.scored.plan.describe() in plan.describe()  # the same plan, scored both ways
    traces = RankTraces(spec, progress=lambda _line: None)
    traces.trace([plan])
    traced = traces.get(plan).prediction(spec.host_bytes()).peak
    error = (best.peak - traced) / traced
    assert UNDER <= error <= OVER, (checkpointing, best.peak, traced, f"{error:+.2%}")
