"""The search: monotone in the budget, deterministic, golden plans for hand-made cases, and the
explanations (`memtrain plan` table and JSON, `PlanError` with what to change)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from memtrain.cli import main
from memtrain.errors import PlanError
from memtrain.memory.footprint import Footprint
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.plan import Plan
from memtrain.planner.cost import StepCost
from memtrain.planner.memory_model import Prediction, StateLevels
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.search import Scored, rank, search
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.micro_batching import MicroBatching
from memtrain.strategies.optimizer import OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding import Sharding

from helpers import probe_of, tiny_recipe_dict
from planner_cases import MODEL, cpu_target, plan_on, planner_recipe

MiB = 2**20


def synthetic(count: int, seed: int) -> list[Scored]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        peak = rng.randrange(1, 1000) * MiB
        seconds = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0])  # ties happen: the order must still be total
        candidate = Plan(
            Precision(), NoCheckpointing(), OptimizerStates(), Sharding(), MicroBatching(i + 1, 1)
        )
        out.append(
            Scored(
                candidate,
                Prediction(Footprint(activations=peak), Footprint(activations=peak), "x"),
                StepCost(seconds, 0, 0, 0, 0, 0),
                StateLevels(0, 0, 0, 0, 0, 0),
            )
        )
    return out


@pytest.mark.parametrize("seed", range(20))
def test_budget_is_monotone(seed: int) -> None:
    """A larger budget never picks a plan predicted slower; a smaller one never one predicted bigger."""
    scored = synthetic(60, seed)
    budgets = sorted(random.Random(seed).randrange(1, 1000) * MiB for _ in range(15))
    chosen = [rank(scored, b)[0][0] if rank(scored, b)[0] else None for b in budgets]
    for small, large, budget in zip(chosen, chosen[1:], budgets, strict=False):
        if small is None:
            continue
        assert large is not None
        assert large.cost.total <= small.cost.total
        # the larger budget's choice either does not fit the smaller one, or both budgets choose it
        assert small.prediction.peak <= large.prediction.peak or large.prediction.peak > budget


def test_ranking_is_deterministic() -> None:
    scored = synthetic(80, 7)
    shuffled = list(scored)
    random.Random(1).shuffle(shuffled)
    assert rank(scored, 500 * MiB) == rank(shuffled, 500 * MiB)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> ModelProbe:
    torch.set_num_threads(1)
    return probe_of(planner_recipe(tmp_path_factory.mktemp("probe")))


GOLDEN = [  # usable bytes -> (checkpointing, fraction, optimizer states, micro-batch) with the CPU cost model
    (2**40, ("none", 1.0, "fp32", 8)),  # everything fits: no recompute, one micro-step, fastest optimizer
    (7_000_000, ("none", 1.0, "fp32", 4)),  # two micro-steps cost less than recomputing five blocks
    (4_000_000, ("full", 1.0, "bf16", 8)),  # recompute all blocks, and bf16 states to fit one micro-step
]


@pytest.mark.parametrize(("usable", "expected"), GOLDEN, ids=["unbounded", "7MB", "4MB"])
def test_golden_plans(
    tmp_path: Path, probe: ModelProbe, usable: int, expected: tuple[str, float, str, int]
) -> None:
    result = plan_on(planner_recipe(tmp_path), cpu_target(usable), probe)
    c = result.plan
    fraction = getattr(c.checkpointing, "fraction", 1.0)
    assert (c.checkpointing.name, fraction, c.optimizer_states.name, c.micro_batch_size) == expected
    assert c.precision.name == "fp32" and c.sharding.name == "none" and c.world_size == 1
    assert c.micro_batch_size * c.accumulation_steps == 8
    assert result.predicted is not None and result.predicted.peak <= usable


def test_auto_precision_keeps_fp32_numerics_and_lists_are_honoured(tmp_path: Path, probe: ModelProbe) -> None:
    auto = plan_on(planner_recipe(tmp_path, strategies={"precision": "auto"}), cpu_target(), probe)
    assert {s.plan.precision.name for s in auto.ranked} == {"fp32"}  # CPU: bf16-mixed only on a bf16 GPU
    listed = plan_on(
        planner_recipe(tmp_path, strategies={"precision": ["bf16-master", "fp32"]}), cpu_target(), probe
    )
    assert {s.plan.precision.name for s in listed.ranked} == {"bf16-master", "fp32"}
    gpu = search(
        planner_recipe(tmp_path, strategies={"precision": "auto"}),
        probe,
        what_if_target(1, load_gpu("a100-80gb"), None, None),
        torch.device("cuda", 0),
    )
    assert {s.plan.precision.name for s in gpu.ranked} == {"bf16-mixed", "fp32"}
    assert gpu.plan.precision.name == "bf16-mixed"  # faster on a GPU, same numerics class


def test_options_that_cannot_run_are_excluded_with_the_reason(tmp_path: Path, probe: ModelProbe) -> None:
    recipe = planner_recipe(tmp_path, strategies={"precision": ["fp8", "bf16-mixed"]})
    result = search(
        recipe, probe, what_if_target(1, load_gpu("a100-80gb"), None, None), torch.device("cuda", 0)
    )
    reasons = dict(result.excluded)
    assert "compute capability >= 8.9" in reasons["strategies.precision=fp8"]
    assert {s.plan.precision.name for s in result.ranked} == {"bf16-mixed"}


def test_nothing_fits_raises_plan_error_with_the_table(tmp_path: Path, probe: ModelProbe) -> None:
    with pytest.raises(PlanError) as caught:
        plan_on(planner_recipe(tmp_path, strategies={"checkpointing": "none"}), cpu_target(2_000_000), probe)
    message = str(caught.value)
    assert message.startswith("no plan fits the memory budget")
    assert "closest: precision=fp32 checkpointing=none" in message and "short" in message
    assert "micro x acc" in message  # the table of the closest plans
    assert "strategies.checkpointing=auto (now none)" in message  # what to change


def _recipe_file(tmp_path: Path, **sections: dict[str, object]) -> Path:
    raw = tiny_recipe_dict(
        tmp_path,
        model={"config": MODEL},
        batch={"global_size": 8, "micro_size": "auto"},
        data={"seq_len": 32, "synthetic": {"num_samples": 16, "min_len": 0}},
        strategies={"precision": "fp32", "checkpointing": "auto", "optimizer_states": "auto"},
        **sections,
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plan_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(_recipe_file(tmp_path, memory={"budget": 5_000_000})), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"plan", "predicted", "budget", "candidates", "cheapest_infeasible"}
    assert set(doc["plan"]) == {
        "quantization",
        "adapters",
        "precision",
        "checkpointing",
        "loss",
        "optimizer",
        "optimizer_states",
        "optimizer_step",
        "sharding",
        "micro_batching",
        "compile",
        "world_size",
    }
    assert Plan.from_dict(doc["plan"]).to_dict() == doc["plan"], "plan --json round-trips"
    assert set(doc["summary"]) >= {"precision", "checkpointing", "micro_batch_size", "accumulation_steps"}
    assert set(doc["predicted"]) == {
        "weights",
        "gradients",
        "optimizer_states",
        "activations",
        "other",
        "peak",
    }
    assert set(doc["budget"]) == {"total", "free", "reserve", "usable"}
    assert all(isinstance(v, int) for v in (*doc["predicted"].values(), *doc["budget"].values()))
    assert doc["budget"]["total"] == 5_000_000 and doc["predicted"]["peak"] <= doc["budget"]["usable"]
    assert doc["cheapest_infeasible"]["fits"] is False and doc["cheapest_infeasible"]["short_bytes"] > 0


def test_plan_command_table_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(_recipe_file(tmp_path, memory={"budget": 5_000_000}))]) == 0
    table = capsys.readouterr().out
    assert "budget per rank" in table and "chosen:" in table and "fastest plan that does not fit" in table
    assert main(["plan", str(_recipe_file(tmp_path, memory={"budget": 1_000_000}))]) == 2
    err = capsys.readouterr().err
    assert "no plan fits the memory budget" in err and "to make a plan fit" in err
