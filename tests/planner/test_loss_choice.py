"""The planner's loss choice: `chunked` or `fused` when it lets a faster plan fit, never `chunked` when
memory is to spare (the same plan minus the head's recompute), and `standard` only for a model that
post-processes logits."""

from __future__ import annotations

from pathlib import Path

import pytest

from memtrain.strategies.loss import Chunked, Fused, Loss

from helpers import TINY_GEMMA2
from planner_cases import MODEL, cpu_target, plan_on, planner_recipe

BIG_VOCAB = {**MODEL, "vocab_size": 8192, "num_hidden_layers": 2}


pytestmark = pytest.mark.usefixtures("one_thread")


def test_chunked_when_it_lets_a_faster_plan_fit(tmp_path: Path) -> None:
    recipe = planner_recipe(
        tmp_path,
        model={"config": BIG_VOCAB},
        strategies={"loss": ["standard", "chunked"], "loss_chunk_tokens": 32},
    )
    plentiful = plan_on(recipe, cpu_target())
    fastest = plentiful.plan
    assert fastest.loss == Loss()  # memory to spare: the same plan without the head's recompute
    scored = {(s.plan.loss.name, s.plan.replace(loss=Loss())): s for s in plentiful.ranked}
    with_chunked = scored[("chunked", fastest)]
    assert with_chunked.prediction.peak < scored[("standard", fastest)].prediction.peak
    # a budget the fastest plan fits only with the chunked loss: the planner takes it over every standard
    # plan that fits (smaller micro-batches, recomputation), which are slower
    tight = plan_on(recipe, cpu_target(with_chunked.prediction.peak))
    assert tight.plan == fastest.replace(loss=Chunked(32)), tight.plan.describe()
    standard_fits = [s for s in tight.ranked if s.plan.loss == Loss()]
    assert standard_fits and all(s.cost.total > tight.chosen.cost.total for s in standard_fits)


def test_softcapping_model_plans_with_standard(tmp_path: Path) -> None:
    gemma2 = {**TINY_GEMMA2, "vocab_size": 256}
    recipe = planner_recipe(
        tmp_path,
        model={"config": gemma2, "attn_implementation": "eager"},
        strategies={"loss": "auto", "checkpointing": "none", "optimizer_states": "fp32"},
    )
    result = plan_on(recipe, cpu_target())
    assert result.plan.loss == Loss()
    assert all(s.plan.loss == Loss() for s in (*result.ranked, *result.infeasible))
    assert any("final_logit_softcapping" in reason for _, reason in result.excluded), result.excluded


def test_fused_costs_no_recompute_and_fits_where_standard_does_not(tmp_path: Path) -> None:
    recipe = planner_recipe(
        tmp_path, model={"config": BIG_VOCAB}, strategies={"loss": "auto", "loss_chunk_tokens": 32}
    )
    plentiful = plan_on(recipe, cpu_target())
    scored = {(s.plan.loss.name, s.plan.replace(loss=Loss())): s for s in plentiful.ranked}
    base = plentiful.plan.replace(loss=Loss())
    standard, chunked, fused = (scored[(name, base)] for name in ("standard", "chunked", "fused"))
    assert fused.cost.total == standard.cost.total < chunked.cost.total  # no second head forward
    assert fused.prediction.peak < standard.prediction.peak
    # at equal time the lower peak wins: with memory to spare the planner never pays for a recompute
    assert plentiful.plan == base.replace(loss=Fused(32)), plentiful.plan.describe()
    tight = plan_on(recipe, cpu_target(fused.prediction.peak))
    assert tight.plan.loss != Loss() and tight.chosen.cost.total <= fused.cost.total
