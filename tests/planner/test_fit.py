"""Fit: for a sweep of simulated budgets, the plan the planner chooses trains under that budget.

Each run goes through the real entry point (`CausalLMTrainer` resolves its plan with the planner, from
the simulated budget `memory.budget`), trains three steps with every storage counted against the budget,
and must neither hit the simulated out-of-memory error (which the trainer would otherwise recover from)
nor peak above the budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer

from planner_cases import planner_recipe

BUDGETS = [3_200_000, 4_000_000, 5_000_000, 6_500_000, 9_000_000, 12_000_000]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("budget", BUDGETS)
def test_chosen_plan_trains_under_the_budget(tmp_path: Path, budget: int) -> None:
    recipe = planner_recipe(tmp_path, memory={"budget": budget}, train={"steps": 3})
    trainer = CausalLMTrainer(recipe)
    result = trainer.fit()
    assert result.steps_done == 3
    assert trainer.monitor.oom_events == [], trainer.monitor.oom_events
    measured = max(report.peak_bytes for report in trainer.monitor.memory_reports)
    assert measured <= budget
    usable = int(budget * (1 - 0.02))  # the CPU safety fraction
    assert measured <= usable, (trainer.plan, measured, usable)


def test_calibration_compares_prediction_and_measurement(tmp_path: Path) -> None:
    """What the trainer writes into plan.json: the planner's prediction next to the tracker's step."""
    from memtrain.distributed import DistEnv
    from memtrain.planner import calibration, make_plan

    recipe = planner_recipe(tmp_path, memory={"budget": 6_500_000}, train={"steps": 3})
    spec = CausalLMTrainer(recipe).model_spec()
    result = make_plan(recipe, DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), spec)
    trainer = CausalLMTrainer(recipe)
    trainer.setup()
    assert trainer.plan == result.plan  # deterministic: the trainer resolves the same plan
    trainer.fit()
    report = calibration(result, trainer.monitor.memory_reports[-1])
    assert (
        set(report["predicted"])
        == set(report["measured"])
        == {"weights", "gradients", "optimizer_states", "activations", "other", "peak"}
    )
    assert abs(report["relative_error"]["peak"]) < 0.03
