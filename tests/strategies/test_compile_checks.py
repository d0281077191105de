"""`strategies.compile`'s refusals, each naming the key, and `none` leaving no trace (no compile runs here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.mesh import MeshShape
from memtrain.plan import pinned_plan
from memtrain.strategies.checkpointing import CHECKPOINTING
from memtrain.strategies.compile import COMPILE, compiled_modules, is_compiled, uncompile
from memtrain.strategies.registry import DeviceFacts
from memtrain.strategies.sharding import SHARDING

from helpers import tiny_recipe

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.mark.parametrize("name", ["blocks", "model"])
def test_offload_checkpointing_and_deepspeed_are_refused_by_name(tmp_path: Path, name: str) -> None:
    offload = tiny_recipe(tmp_path, strategies={"compile": name, "checkpointing": "offload"})
    with pytest.raises(Unsupported, match=r"strategies\.compile: .*strategies\.checkpointing=offload"):
        pinned_plan(offload, CPU)
    deepspeed = SHARDING.create("zero2", {"sharding_backend": "deepspeed"})
    with pytest.raises(Unsupported, match=r"strategies\.compile.*sharding_backend=deepspeed"):
        COMPILE.create(name).check_with(CHECKPOINTING.create("full"), deepspeed)


def test_pipeline_stages_and_other_devices_are_refused_and_none_runs_anywhere() -> None:
    stages = DeviceFacts("cuda", 2, mesh=MeshShape(pp=2))
    with pytest.raises(Unsupported, match=r"strategies\.compile: blocks .*strategies\.mesh\.pp"):
        COMPILE.create("blocks").check(stages)
    with pytest.raises(Unsupported, match=r"strategies\.compile: model .*mps"):
        COMPILE.create("model").check(DeviceFacts("mps"))
    COMPILE.create("none").check(stages)
    COMPILE.create("none").check(DeviceFacts("mps"))


def test_an_open_compile_leaves_the_refused_combination_out_of_the_grid(tmp_path: Path) -> None:
    from memtrain.planner.candidates import build_grid

    recipe = tiny_recipe(
        tmp_path,
        strategies={"compile": "auto", "checkpointing": ["none", "offload"], "optimizer_states": "fp32"},
    )
    grid = build_grid(recipe, DeviceFacts("cpu"), torch.device("cpu"), num_blocks=2)
    pairs = {(p.checkpointing.name, p.compile.name) for p in grid.candidates}
    assert ("offload", "blocks") not in pairs and ("offload", "none") in pairs and ("none", "model") in pairs
    assert any(
        "strategies.compile=blocks" in key and "saved-tensor hooks" in why for key, why in grid.excluded
    )


@pytest.mark.slow  # the first `nn.Module.compile` imports Dynamo and Inductor (6 s)
def test_none_leaves_no_trace_and_uncompile_undoes_compile() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    blocks = list(model)
    COMPILE.create("none").apply(model, blocks)
    assert compiled_modules(model) == [] and not any(
        "_compiled_call_impl" in vars(m) for m in model.modules()
    )
    COMPILE.create("blocks").apply(model, blocks)  # lazy: nothing is traced until a call
    assert compiled_modules(model) == ["0", "1"]
    uncompile(blocks)
    assert not any(is_compiled(m) for m in model.modules())


@pytest.mark.slow  # imports Dynamo and Inductor (6 s); nothing is compiled
def test_a_block_that_cannot_compile_runs_eager_and_says_so() -> None:
    import torch._dynamo.exc

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    blocks = list(model)
    expected = model(torch.ones(2, 4))
    COMPILE.create("blocks").apply(model, blocks)

    def fails(*_args: object, **_kwargs: object) -> None:
        raise torch._dynamo.exc.Unsupported("an op Inductor has no lowering for")

    for block in blocks:
        block._compiled_call_impl.__wrapped__ = fails  # type: ignore[union-attr]
    with pytest.warns(
        UserWarning, match=r"strategies\.compile=blocks: 0 \(Linear\) cannot compile and runs eager"
    ):
        out = model(torch.ones(2, 4))
    assert torch.equal(out, expected) and not any(is_compiled(b) for b in blocks)


def test_the_tracker_says_a_compiled_plan_trains_eager_under_it(tmp_path: Path) -> None:
    """The tracker's dispatch mode makes dynamo run compiled modules eagerly (planner/compiled_trace.py):
    a compiled plan with `memory.track` says so instead of silently training eager."""
    from memtrain.causal_lm.trainer import CausalLMTrainer

    recipe = tiny_recipe(
        tmp_path,
        strategies={"compile": "blocks", "checkpointing": "none", "optimizer_states": "fp32"},
        memory={"track": True},
        train={"steps": 1},
    )
    with pytest.warns(UserWarning, match="memory.track / memory.budget: .* trains and is measured eager"):
        CausalLMTrainer(recipe).fit()
