"""`selective-op` (torchtitan's op-level selective checkpointing) in the planner: its traces keep what the
policy keeps on the CPU and on a CUDA target, its prediction matches the tracker on several families, and
`auto` picks it when it is the fastest plan that fits (issue 39).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.memory.footprint import COMPONENTS
from memtrain.memory.headroom import Target, budget_from
from memtrain.planner.activations import SegmentKey
from memtrain.planner.search import search
from memtrain.strategies.checkpointing import CHECKPOINTING
from memtrain.strategies.precision import PRECISION

from helpers import probe_of, tiny_recipe
from planner_cases import MODEL, UNBOUNDED, cpu_target, plan_on, planner_recipe, scored_plan

pytestmark = pytest.mark.usefixtures("one_thread")

ACTIVATIONS = COMPONENTS.index("activations")
MAX_OVER, MAX_UNDER = 0.03, -0.005  # test_recompute_modes.py's bounds
SM90 = (9, 0)
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 5, "n_head": 4, "n_positions": 64, "vocab_size": 256}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": MODEL,
    "qwen2": {**MODEL, "model_type": "qwen2"},
    "gpt2": GPT2,
}


@pytest.mark.parametrize(
    ("family", "precision"),
    [("llama", "fp32"), ("llama", "bf16-mixed"), ("qwen2", "bf16-mixed"), ("gpt2", "fp32")],
)
def test_predicted_peak_matches_the_tracker(tmp_path: Path, family: str, precision: str) -> None:
    """qwen2's q, k and v have biases (addmm: recomputed, not counted); gpt2's every linear does."""
    pinned = {"precision": precision, "checkpointing": "selective-op", "optimizer_states": "fp32"}
    model = {"config": FAMILIES[family]}
    searched = plan_on(planner_recipe(tmp_path, model=model, strategies=pinned), cpu_target())
    predicted = scored_plan(searched, micro_batch_size=4).prediction.peak
    run = planner_recipe(
        tmp_path,
        model=model,
        strategies=pinned,
        batch={"micro_size": 4},
        memory={"track": True},
        train={"steps": 3},
    )
    trainer = CausalLMTrainer(run)
    trainer.fit()
    measured = trainer.monitor.memory_reports[-1].peak_bytes
    assert MAX_UNDER <= (predicted - measured) / measured <= MAX_OVER, (predicted, measured)


SEQ, ROWS = 64, (1, 2)


@pytest.fixture(scope="module")
def llama_probe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    data = {"seq_len": SEQ, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}}
    recipe = tiny_recipe(tmp_path_factory.mktemp("llama"), model={"config": MODEL}, data=data)
    return probe_of(recipe)


def _kept(probe: Any, precision: str, mode: str, capability: tuple[int, int] | None) -> float:
    """Activation bytes the middle block keeps through the forward, at 2 rows."""
    fitted = probe.trace(
        PRECISION.create(precision), CHECKPOINTING.create(mode), ROWS, None, None, capability
    )
    return fitted.at(SegmentKey("first", "fwd.block", 1), ROWS[1] * SEQ).end[ACTIVATIONS]


def test_a_block_keeps_q_v_gate_down_and_attention(llama_probe: Any) -> None:
    """fp32 on the CPU: the block keeps its q, v, gate and down projections (the 1st, 3rd, 5th and 7th
    mm), the CPU flash kernel's output and fp32 log-sum-exp, and its own output (the next block's input);
    k, o, up and every elementwise result are recomputed."""
    hidden, inter, heads = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_attention_heads"]
    kv = MODEL["num_key_value_heads"] * hidden // heads
    tokens = ROWS[1] * SEQ
    expected = 4 * tokens * (hidden + kv + inter + hidden + hidden + hidden) + 4 * tokens * heads
    assert _kept(llama_probe, "fp32", "selective-op", None) == expected


def test_the_cuda_trace_keeps_the_cuda_kernels_outputs(llama_probe: Any) -> None:
    """bf16-mixed, traced as an H100 runs it: SDPA runs the CUDA flash kernel, whose output the policy
    keeps (with its RNG state, as without checkpointing); against `selective`, only the k, o and up
    projections' bf16 outputs are missing, on the CPU kernel and on the CUDA one alike."""
    hidden, inter = MODEL["hidden_size"], MODEL["intermediate_size"]
    kv = MODEL["num_key_value_heads"] * hidden // MODEL["num_attention_heads"]
    recomputed = 2 * ROWS[1] * SEQ * (kv + hidden + inter)
    for capability in (None, SM90):
        op, selective = (
            _kept(llama_probe, "bf16-mixed", m, capability) for m in ("selective-op", "selective")
        )
        assert selective - op == recomputed, capability
    rng_state = _kept(llama_probe, "bf16-mixed", "none", SM90) - _kept(
        llama_probe, "bf16-mixed", "none", None
    )
    assert rng_state > 0
    op_cuda, op_cpu = (_kept(llama_probe, "bf16-mixed", "selective-op", c) for c in (SM90, None))
    assert op_cuda - op_cpu == rng_state


WIDE = {  # compute large enough, against a checkpointed call's fixed cost, for recompute to rank plans
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
}


def _cuda(usable: int) -> Target:
    return Target(
        "cuda", 1, budget_from(usable, usable, 0, 0.0, "test"), bf16=True, fp8=False, compute_capability=SM90
    )


def test_auto_picks_it_when_it_is_the_fastest_plan_that_fits(tmp_path: Path) -> None:
    """On an H100-like target: it recomputes more than `selective` and less than `full`; with a budget
    between its own need and that of every faster plan (`selective` among them), `auto` chooses it."""
    recipe = tiny_recipe(
        tmp_path,
        model={"config": WIDE},
        data={"seq_len": 2048, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}},
        batch={"global_size": 2, "micro_size": 2},
        strategies={"precision": "bf16-mixed", "checkpointing": "auto", "optimizer_states": "fp32"},
    )
    probe = probe_of(recipe)
    everything = search(recipe, probe, _cuda(UNBOUNDED), torch.device("cuda", 0))
    by_mode = {s.plan.checkpointing.describe(): s for s in everything.ranked}
    op = by_mode["selective-op"]
    assert by_mode["selective"].cost.recompute < op.cost.recompute < by_mode["full"].cost.recompute
    faster = [s for s in everything.ranked if s.cost.total < op.cost.total]
    assert "selective" in {s.plan.checkpointing.name for s in faster}
    needed = min(s.prediction.required for s in faster)
    assert op.prediction.required < needed
    chosen = search(recipe, probe, _cuda((op.prediction.required + needed) // 2), torch.device("cuda", 0))
    assert chosen.plan.checkpointing == CHECKPOINTING.create("selective-op")
