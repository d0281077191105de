"""`strategies.optimizer_step: in_backward`: the same training as a standard step, without the gradients'
memory, predicted by the planner, chosen when only it fits, refused where it would not be exact; with
`train.grad_clip`, two passes (norm, then update) that clip exactly as the standard step does."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import PlanError, Unsupported
from memtrain.memory.headroom import Target, budget_from
from memtrain.planner.search import search
from memtrain.run import RunLayout
from memtrain.strategies.micro_batching import MicroBatching, TokenBudget
from memtrain.strategies.optimizer_step import InBackward, InBackwardOptimizer, OptimizerStep
from memtrain.strategies.precision import PRECISION
from memtrain.strategies.sharding import SHARDING

from helpers import TINY_LLAMA, probe_of, tiny_recipe

pytestmark = pytest.mark.usefixtures("shared_traces")  # tests/conftest.py: they plan alike jobs

# Wide enough that the gradients are a large part of the peak, small enough to train in a second.
MODEL = {
    **TINY_LLAMA,
    "hidden_size": 128,
    "intermediate_size": 256,
    "vocab_size": 256,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
}


def recipe_for(tmp_path: Path, step: str | list[str], **sections: dict[str, Any]) -> CausalLMRecipe:
    base: dict[str, dict[str, Any]] = {
        "model": {"config": MODEL},
        "batch": {"global_size": 1, "micro_size": "auto"},
        "data": {"synthetic": {"num_samples": 64, "min_len": 0}},
        "train": {"steps": 3, "grad_clip": None},
        "strategies": {"optimizer_step": step, "optimizer_states": "fp32", "checkpointing": "none"},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_recipe(tmp_path, **base)


def trained(recipe: CausalLMRecipe, resume: bool = False) -> CausalLMTrainer:
    trainer = CausalLMTrainer(recipe)
    trainer.fit(resume=resume)
    return trainer


def parameters(trainer: CausalLMTrainer) -> list[torch.Tensor]:
    assert trainer.model is not None
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_same_parameters_as_a_standard_step(tmp_path: Path) -> None:
    small = {"config": TINY_LLAMA}
    batch = {"global_size": 8, "micro_size": 8}
    standard = CausalLMTrainer(recipe_for(tmp_path / "a", "standard", model=small, batch=batch))
    in_backward = CausalLMTrainer(recipe_for(tmp_path / "b", "in_backward", model=small, batch=batch))
    losses = [trainer.fit().losses for trainer in (standard, in_backward)]
    assert losses[0] == losses[1]
    assert isinstance(in_backward.optimizer, InBackwardOptimizer)
    assert in_backward.plan.optimizer_step == InBackward()
    for a, b in zip(parameters(standard), parameters(in_backward), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def grad_norms(trainer: CausalLMTrainer) -> list[float]:
    rows = RunLayout(trainer.run_dir).metrics_file.read_text(encoding="utf-8").splitlines()
    return [json.loads(row)["grad_norm"] for row in rows]


def test_clipped_in_backward_is_the_standard_clipped_step(tmp_path: Path) -> None:
    """The hole: `in_backward` refused `train.grad_clip` (the global norm is unknown when the first
    parameter steps). Now a norm pass, then an update pass with `clip_grad_norm_`'s factor: the losses,
    gradient norms and parameters of 3 steps equal the standard clipped step's, with a clip that bites every
    step and attention dropout on (the update pass must replay the norm pass's random numbers)."""
    dropout = {"config": {**TINY_LLAMA, "attention_dropout": 0.2}}
    sections: dict[str, dict[str, Any]] = {
        "model": dropout,
        "batch": {"global_size": 4, "micro_size": 4},
        "train": {"grad_clip": 0.05},
        "output": {"loggers": ["jsonl"]},
    }
    standard = CausalLMTrainer(recipe_for(tmp_path / "a", "standard", **sections))
    clipped = CausalLMTrainer(recipe_for(tmp_path / "b", "in_backward", **sections))
    losses = [trainer.fit().losses for trainer in (standard, clipped)]
    assert isinstance(clipped.optimizer, InBackwardOptimizer)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    norms = [grad_norms(trainer) for trainer in (standard, clipped)]
    assert min(norms[0]) > 10 * 0.05, norms  # the clip scales every step's update
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-5, atol=0)
    for a, b in zip(parameters(standard), parameters(clipped), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    unclipped = CausalLMTrainer(recipe_for(tmp_path / "c", "standard", **{**sections, "train": {}}))
    unclipped.fit()
    assert any(  # the clip changed training, so the equality above is the clip's
        not torch.allclose(a, b, atol=1e-4)
        for a, b in zip(parameters(standard), parameters(unclipped), strict=True)
    )


@pytest.mark.parametrize(("states", "clip"), [("fp32", None), ("8bit", None), ("fp32", 0.05)])
def test_peak_falls_by_the_gradients_and_is_predicted(
    tmp_path: Path, states: str, clip: float | None
) -> None:
    """With `train.grad_clip` (the two passes) the peak is that of one unclipped step in backward (the
    norm pass holds one gradient and no step temporaries) and the prediction holds."""

    def run(step: str) -> CausalLMTrainer:
        recipe = recipe_for(
            tmp_path / step,
            step,
            memory={"track": True},
            strategies={"optimizer_states": states},
            train={"grad_clip": clip},
        )
        return trained(recipe)

    standard, in_backward = run("standard"), run("in_backward")
    measured = in_backward.monitor.memory_reports[-1]
    gradients = standard.monitor.memory_reports[-1].component_peaks["gradients"]
    largest = max(p.numel() for p in in_backward.model.parameters()) * 4  # type: ignore[union-attr]
    # The peak falls by the gradients, less the activations backward still holds when a step runs (the
    # standard step's optimizer phase has none) and one step's gradient and temporaries.
    limit = (
        standard.monitor.memory_reports[-1].peak_bytes
        - gradients
        + measured.at_peak["activations"]
        + 3 * largest
    )
    assert measured.peak_bytes <= limit, (measured.peak_bytes, limit)
    assert standard.monitor.memory_reports[-1].peak_bytes - measured.peak_bytes > gradients / 2
    assert measured.component_peaks["gradients"] <= largest  # never more than one gradient
    predicted = in_backward.plan_result.predicted  # type: ignore[union-attr]
    assert predicted is not None
    error = predicted.peak / measured.peak_bytes - 1
    assert -0.005 <= error <= 0.03, (predicted, measured.peak_bytes)


def cpu_target(usable: int) -> Target:
    return Target("cpu", 1, budget_from(usable, usable, 0, 0.0, "test"), bf16=True, fp8=False)


def test_planner_takes_in_backward_only_where_it_fits_and_is_exact(tmp_path: Path) -> None:
    recipe = recipe_for(tmp_path, "auto", strategies={"optimizer_states": "auto"})
    probe = probe_of(recipe)
    plentiful = search(recipe, probe, cpu_target(2**50), torch.device("cpu"))
    standard = min(s.prediction.peak for s in plentiful.ranked if not s.plan.optimizer_step.in_backward)
    tight = search(recipe, probe, cpu_target(standard - 1), torch.device("cpu"))
    assert tight.plan.optimizer_step == InBackward(), tight.plan.describe()
    assert all(s.plan.optimizer_step.in_backward for s in tight.ranked)

    # clipping: two passes a step, so with memory to spare the standard step ranks first; when only
    # the step in backward fits, the planner takes it
    clipped = recipe_for(tmp_path, "auto", train={"grad_clip": 1.0}, strategies={"optimizer_states": "auto"})
    clipped_probe = probe_of(clipped)
    result = search(clipped, clipped_probe, cpu_target(2**50), torch.device("cpu"))
    assert result.plan.optimizer_step == OptimizerStep(), result.plan.describe()
    standard_cost = {s.plan: s.cost for s in result.ranked if not s.plan.optimizer_step.in_backward}
    twice = [s for s in result.ranked if s.plan.optimizer_step.in_backward]
    assert twice, "the step in backward is a candidate with clipping"
    for scored in twice:  # a second forward and backward: twice the compute of the same plan
        alone = standard_cost[scored.plan.replace(optimizer_step=OptimizerStep())]
        assert scored.cost.compute == pytest.approx(2 * alone.compute, rel=1e-9)
        assert scored.cost.total > alone.total
    tight = search(clipped, clipped_probe, cpu_target(standard - 1), torch.device("cpu"))
    assert tight.plan.optimizer_step == InBackward(), tight.plan.describe()

    accumulating = recipe_for(tmp_path, "auto", batch={"global_size": 4, "micro_size": "auto"})
    result = search(accumulating, probe_of(accumulating), cpu_target(2**50), torch.device("cpu"))
    steps = {(s.plan.accumulation_steps, s.plan.optimizer_step.name) for s in result.ranked}
    assert (1, "in_backward") in steps and (2, "standard") in steps
    assert not any(acc > 1 and name == "in_backward" for acc, name in steps)


def test_resume_continues_identically(tmp_path: Path) -> None:
    def recipe(where: str, steps: int, step: str = "in_backward") -> CausalLMRecipe:
        return recipe_for(
            tmp_path / where,
            step,
            train={"steps": steps, "min_lr_ratio": 1.0},  # one lr: the 2-step run decays like the 4-step one
            checkpoint={"every": 2, "at_end": True},
        )

    straight = trained(recipe("straight", 4))
    trained(recipe("resumed", 2))
    resumed = trained(recipe("resumed", 4), resume=True)
    assert resumed.optimizer is not None
    saved = resumed.optimizer.state_dict()
    assert sorted(saved["state"]) == list(range(len(saved["param_groups"][0]["params"])))
    for a, b in zip(parameters(straight), parameters(resumed), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    # the optimizer state has the standard layout: a standard run's checkpoint goes on in backward
    trained(recipe("switched", 2, "standard"))
    switched = trained(recipe("switched", 4), resume=True)
    for a, b in zip(parameters(straight), parameters(switched), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_a_step_half_done_in_backward_cannot_be_redone() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = InBackwardOptimizer(model.parameters(), lambda params: torch.optim.AdamW(params, lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # stepped and freed in backward
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    with pytest.raises(PlanError, match="cannot be redone exactly"):
        optimizer.check_redoable(0)  # an out-of-memory error now would step some parameters twice
    assert optimizer.finish_step() > 0
    optimizer.check_redoable(1)


def test_a_clipped_step_measures_first_and_skips_a_non_finite_norm() -> None:
    """The norm pass moves nothing and keeps no gradient; a non-finite norm is known before any parameter
    steps, so the step is skipped (unclipped, `in_backward` has stepped some parameters by the time a
    non-finite gradient appears) and nothing is left to redo; a finite one scales each step's gradient
    by `clip_grad_norm_`'s factor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = InBackwardOptimizer(model.parameters(), lambda params: torch.optim.SGD(params, lr=1.0))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.begin_norm_pass()
    (model(torch.ones(2, 4)).sum() * math.inf).backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    optimizer.check_redoable(0)  # nothing stepped: an out-of-memory error could redo the step
    assert not optimizer.begin_update_pass(1.0)
    assert not math.isfinite(optimizer.finish_step())

    reference = copy.deepcopy(model)
    reference(torch.ones(2, 4)).sum().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    optimizer.begin_norm_pass()
    model(torch.ones(2, 4)).sum().backward()
    assert optimizer.begin_update_pass(0.1)
    model(torch.ones(2, 4)).sum().backward()
    assert optimizer.finish_step() == pytest.approx(norm, rel=1e-6) and norm > 0.1
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)


def test_pinned_with_accumulation_names_the_keys(tmp_path: Path) -> None:
    accumulating = recipe_for(
        tmp_path, "in_backward", batch={"global_size": 4, "micro_size": 2}, train={"grad_clip": 1.0}
    )
    with pytest.raises(Unsupported, match="accumulates 2 micro-steps: set batch.micro_size"):
        CausalLMTrainer(accumulating).choose_plan()


REFUSALS = [  # (batching, sharding, precision, what the error must say)
    (MicroBatching(1, 1), "ddp", "fp32", "needs strategies.sharding: none (DDP all-reduces"),
    (MicroBatching(1, 1), "zero3", "fp32", "zero3 reduce-scatters gradients"),
    (MicroBatching(1, 1), "none", "fp16-mixed", "GradScaler unscales"),
    (MicroBatching(1, 1), "none", "bf16-master", "fp32 master copy"),
    (TokenBudget(4, 1, 64), "none", "fp32", "remove batch.micro_tokens"),
]


@pytest.mark.parametrize(("batching", "sharding", "precision", "message"), REFUSALS)
def test_refused_where_a_step_in_backward_would_not_be_exact(
    batching: MicroBatching, sharding: str, precision: str, message: str
) -> None:
    choices = {"sharding": SHARDING.create(sharding), "precision": PRECISION.create(precision)}
    OptimizerStep().check_plan(batching=batching, grad_clip=1.0, **choices)  # standard runs anywhere
    with pytest.raises(Unsupported, match="strategies.optimizer_step: in_backward") as caught:
        InBackward().check_plan(batching=batching, grad_clip=None, **choices)
    assert message in str(caught.value) and "strategies.optimizer_step: standard" in str(caught.value)
