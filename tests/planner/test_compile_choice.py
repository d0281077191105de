"""`strategies.compile: auto`: the step-time model's compile speedup is learned per device from compiled
runs' measured steps (1.0 until one was measured: never assumed faster), and the planner compiles exactly
when the calibrated model says a compiled step is faster (stubbed calibrations, both directions)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from memtrain import planner
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.distributed import DistEnv
from memtrain.plan import Plan, pinned_plan
from memtrain.planner import plan_here
from memtrain.planner import step_time_calibration as stc
from memtrain.planner.cost import COMPILED_TERMS, TERMS, CostModel, StepCost, Workload
from memtrain.strategies.compile import CompileBlocks

from helpers import tiny_recipe

pytestmark = pytest.mark.usefixtures("shared_traces")

SCALE = (2.0, 1.5, 3.0, 0.8, 1.0, 1.0)


def _samples(count: int, seed: int, speedup: float | None) -> list[stc.Sample]:
    """Steps a machine with `SCALE` measures (1% noise); `speedup`: compiled runs whose compute, recompute
    and micro-steps ran that much faster, None: eager runs."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        terms = (rng.uniform(0.05, 0.5), rng.uniform(0.0, 0.2), rng.uniform(0.003, 0.05), 0.02, 0.0, 0.0)
        faster = [speedup if t in COMPILED_TERMS and speedup else 1.0 for t in TERMS]
        seconds = sum(x * k / f for x, k, f in zip(terms, SCALE, faster, strict=True)) * rng.uniform(
            0.99, 1.01
        )
        out.append(stc.Sample(f"plan {i}", terms, seconds, compiled=speedup is not None))
    return out


def test_the_speedup_is_learned_from_compiled_runs_and_leaves_the_eager_fit_alone() -> None:
    base = CostModel.for_device("cpu")
    eager = _samples(8, seed=1, speedup=None)
    assert stc.fit(base, eager).compile_speedup == 1.0  # nothing compiled measured: not assumed faster
    for speedup in (1.4, 0.7):  # faster, and slower (a CPU where the compiled program loses)
        fitted = stc.fit(base, [*eager, *_samples(4, seed=2, speedup=speedup)])
        assert fitted.scale == stc.fit(base, eager).scale  # compiled runs do not bend the eager multipliers
        assert fitted.compile_speedup == pytest.approx(speedup, rel=0.05)
    # round trip through the cache's layout: an eager sample keeps the old layout
    sample = _samples(1, seed=3, speedup=1.2)[0]
    assert stc._sample(sample.to_dict()) == sample and "compiled" not in eager[0].to_dict()


def test_a_compiled_plan_is_timed_by_its_speedup_and_reported_eager() -> None:
    recipe_plan = _a_plan()
    eager_model = CostModel.for_device("cpu")
    model = dataclasses.replace(eager_model, compile_speedup=2.0)
    kwargs = {"micro_tokens": 128, "micro_steps": 1, "state_bytes": 10**6, "offloaded_activation_bytes": 0}
    workload = _workload()
    eager = model.step(workload, recipe_plan, device_type="cpu", **kwargs)
    compiled = model.step(workload, recipe_plan.replace(compile=CompileBlocks()), device_type="cpu", **kwargs)
    for term in TERMS:
        ratio = 2.0 if term in COMPILED_TERMS else 1.0
        assert getattr(compiled, term) * ratio == pytest.approx(getattr(eager, term))
    assert compiled.uncalibrated() == StepCost.from_terms(
        eager.terms()
    )  # the sample a run records: eager terms


@pytest.mark.parametrize(("speedup", "expected"), [(1.5, "blocks"), (1.0, "none"), (0.8, "none")])
def test_auto_compiles_only_where_the_calibrated_model_says_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speedup: float, expected: str
) -> None:
    stub = dataclasses.replace(CostModel.for_device("cpu"), compile_speedup=speedup)
    monkeypatch.setattr(planner, "local_cost_model", lambda *_args, **_kwargs: stub)
    recipe = tiny_recipe(
        tmp_path,
        strategies={"checkpointing": "none", "optimizer_states": "fp32", "compile": "auto"},
    )
    result = plan_here(recipe, CausalLMTrainer(recipe).model_spec())
    assert result.chosen is not None
    assert result.chosen.plan.compile.name == expected
    offered = {s.plan.compile.name for s in result.ranked}
    assert offered == {"none", "blocks", "model"}  # every name was ranked, the choice is the model's


def _a_plan() -> Plan:
    recipe = tiny_recipe(
        Path("/nonexistent"), strategies={"checkpointing": "none", "optimizer_states": "fp32"}
    )
    return pinned_plan(recipe, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))


def _workload() -> Workload:
    return Workload(
        numel=10**6,
        block_numel=8 * 10**5,
        num_blocks=2,
        hidden=64,
        seq_len=128,
        rows_per_step=4,
        world_size=1,
    )
