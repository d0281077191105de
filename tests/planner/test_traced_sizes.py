"""Every size a search traces is one a scored plan's walk reads: which parameters get no gradient (what the
state levels need before any walk) is read from a size of a plan's own fit, not from a trace of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.planner import model_probe
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.search import search

from planner_cases import planner_recipe


@pytest.mark.slow
def test_a_sharded_what_if_traces_only_the_sizes_its_plans_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_probe, "_shared", None)  # every size traced here, none read from another test
    traced: list[tuple[Any, int]] = []
    real = model_probe.trace_step

    def recording(*args: Any, **kwargs: Any) -> Any:
        traced.append((args[7], args[6]))  # weights dtype, rows
        return real(*args, **kwargs)

    monkeypatch.setattr(model_probe, "trace_step", recording)
    recipe = planner_recipe(
        tmp_path,
        strategies={"precision": "bf16-mixed", "sharding": "zero3", "checkpointing": "none"},
    )
    probe = ModelProbe(CausalLMTrainer(recipe).model_spec())
    target = what_if_target(8, load_gpu("h100-80gb"), None, None)
    result = search(recipe, probe, target, torch.device("cuda", 0))
    assert result.plan.sharding.name == "zero3"
    # zero3 hands a bf16-mixed forward bf16 weights: a size traced with the recipe's fp32 weights is read by
    # no plan (before: the parameters without a gradient were read from two such sizes)
    assert traced and all(weights == torch.bfloat16 for weights, _ in traced)
    assert len(traced) == len(set(traced)), "a size was traced twice"
