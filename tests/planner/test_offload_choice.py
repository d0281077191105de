"""Offload as a planner choice (`strategies.sharding_offload: auto`): on a GPU, a ZeRO stage with its states
in host memory when no plan fits without it, never when one does; held to the host memory per rank; not on
a CPU target; suggested by "no plan fits" when it could make the closest plan fit. The acceptance case:
Llama-3-8B on one H100 (what-if) plans with offload. The one-GPU offload plan also trains (one gloo rank,
FSDP2's CPUOffloadPolicy) like the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import PlanError
from memtrain.memory.headroom import Target, budget_from, load_gpu, what_if_target
from memtrain.planner.search import search

from helpers import REPO, probe_of, tiny_recipe
from planner_cases import UNBOUNDED, cpu_target, plan_on, planner_recipe

pytestmark = pytest.mark.usefixtures("one_thread")
GiB = 2**30
OPEN = {"sharding": "auto", "sharding_offload": "auto", "checkpointing": "none", "optimizer_states": "fp32"}


def gpu_target(usable: int, host: int | None = UNBOUNDED) -> Target:
    budget = budget_from(usable, usable, 0, 0.0, "test")
    return Target("cuda", 1, budget, bf16=True, fp8=False, what_if=True, host_bytes=host)


def on_gpu(recipe: Any, target: Target) -> Any:
    return search(recipe, probe_of(recipe), target, torch.device("cuda", 0))


def test_offload_only_when_nothing_fits_without_it(tmp_path: Path) -> None:
    recipe = planner_recipe(tmp_path, strategies=OPEN)
    roomy = on_gpu(recipe, gpu_target(UNBOUNDED))
    assert (roomy.plan.sharding.name, roomy.plan.sharding.offload) == ("none", "none")
    offered = {(s.plan.sharding.name, s.plan.sharding.offload) for s in roomy.ranked}
    assert offered == {("none", "none"), ("zero2", "params"), ("zero3", "params")}  # one rank: stages offload
    without = min(s.prediction.peak for s in roomy.ranked if s.plan.sharding.offload == "none")
    tight = on_gpu(recipe, gpu_target(without - 1))
    assert tight.plan.sharding.offload == "params" and tight.predicted is not None
    assert tight.predicted.peak < without and tight.chosen is not None and tight.chosen.states.host > 0
    assert tight.chosen.cost.offload > 0  # host link and the host's optimizer step are priced


def test_offloaded_states_must_fit_in_host_memory(tmp_path: Path) -> None:
    recipe = planner_recipe(tmp_path, strategies=OPEN)
    roomy = on_gpu(recipe, gpu_target(UNBOUNDED))
    without = min(s.prediction.peak for s in roomy.ranked if s.plan.sharding.offload == "none")
    with pytest.raises(PlanError) as caught:
        on_gpu(recipe, gpu_target(without - 1, host=1024))
    message = str(caught.value)
    assert "in host memory, more than the 0.00 GiB usable" in message
    assert "more host memory per rank (host_memory_bytes" in message


def test_no_offload_on_a_cpu_target(tmp_path: Path) -> None:
    result = plan_on(planner_recipe(tmp_path, strategies={**OPEN, "sharding": "zero3"}), cpu_target())
    assert {s.plan.sharding.offload for s in (*result.ranked, *result.infeasible)} == {"none"}
    reasons = dict(result.excluded)
    assert "the device's own memory" in reasons["strategies.sharding_offload=params"]


def test_no_plan_fits_suggests_offload(tmp_path: Path) -> None:
    recipe = planner_recipe(tmp_path, strategies={**OPEN, "sharding_offload": "none"})
    smallest = min(s.prediction.peak for s in on_gpu(recipe, gpu_target(UNBOUNDED)).ranked)
    with pytest.raises(PlanError, match=r"strategies.sharding_offload=auto \(now none\)"):
        on_gpu(recipe, gpu_target(smallest - 1))


EIGHT_B = REPO / "recipes/llama3-8b-8xh100.yaml"
ONE_MODE = ["strategies.checkpointing=full", "strategies.loss=standard"]  # one trace keeps it short
OPENED = ["strategies.optimizer_states=auto", "strategies.sharding=auto"]


def test_llama3_8b_on_one_h100_plans_with_offload() -> None:
    """`memtrain plan recipes/llama3-8b-8xh100.yaml --gpu h100-80gb --world-size 1` with optimizer states
    and sharding open: without offload no plan fits (weights, gradients and states of 8B are ~75 GiB of the
    70 GiB usable) and the error says to open it; with it, FSDP2 keeps the states in host memory."""
    target = what_if_target(1, load_gpu("h100-80gb"), None, None)
    closed = CausalLMRecipe.load(EIGHT_B, [*ONE_MODE, *OPENED])
    probe = probe_of(closed)
    assert 8.0e9 < probe.shape.numel < 8.1e9
    with pytest.raises(PlanError, match=r"strategies.sharding_offload=auto \(now none\)"):
        search(closed, probe, target, torch.device("cuda", 0))
    opened = CausalLMRecipe.load(EIGHT_B, [*ONE_MODE, *OPENED, "strategies.sharding_offload=auto"])
    result = search(opened, probe, target, torch.device("cuda", 0))
    assert result.plan.sharding.offload == "params" and result.plan.sharding.name in ("zero2", "zero3")
    assert result.chosen is not None and result.predicted is not None and result.budget is not None
    assert result.predicted.peak <= result.budget.usable
    host = result.chosen.states.host  # at least the fp32 weights and gradients, within the host's memory
    assert target.host_bytes is not None and 8 * probe.shape.numel < host <= target.host_bytes
    if result.plan.accumulation_steps > 1:  # the unsharded fp32 gradient of 8B (30 GiB) would not fit
        assert result.plan.sharding.gradient_reduction == "per_micro_step"


@pytest.mark.gpu  # also in scripts/gpu_check.sh: FSDP2 with its CPU offload policy on one CUDA rank (NCCL)
def test_one_gpu_offload_plan_trains_like_the_reference(tmp_path: Path) -> None:
    steps = {"train": {"steps": 3}, "batch": {"global_size": 8, "micro_size": 2}}
    reference = CausalLMTrainer(tiny_recipe(tmp_path / "ref", **steps)).fit().losses
    offload = {"sharding": "zero3", "sharding_offload": "params", "gradient_reduction": "per_micro_step"}
    recipe = tiny_recipe(tmp_path / "offload", **steps, strategies=offload)
    try:
        with pytest.warns(UserWarning, match="zero3 on one rank shards nothing"):
            losses = CausalLMTrainer(recipe).fit().losses
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert losses == pytest.approx(reference, rel=1e-5)
