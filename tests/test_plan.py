"""`Plan` is a frozen value of strategy objects: it round-trips through plan.json and checkpoint metadata,
and a resume reads the plan back from the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.plan import Plan
from memtrain.strategies.catalog import REGISTRIES
from memtrain.strategies.checkpointing import FractionCheckpointing
from memtrain.strategies.micro_batching import MicroBatching, TokenBudget
from memtrain.strategies.precision import FP8, Precision
from memtrain.strategies.sharding import SHARDING

from helpers import tiny_recipe


def _every_strategy() -> list[Plan]:
    """A plan per registered strategy of each kind (the others at their defaults), plus options set."""
    default = Plan(
        Precision(),
        FractionCheckpointing(0.25),
        REGISTRIES["optimizer_states"].create("8bit"),
        SHARDING.create("zero3", {"sharding_backend": "deepspeed", "sharding_offload": "optimizer"}),
        TokenBudget(16, 1, 512),
        world_size=4,
    )
    plans = [default, default.replace(precision=FP8(emulate=True), micro_batching=MicroBatching(2, 8))]
    for kind, registry in REGISTRIES.items():
        plans += [default.replace(**{kind: cls()}) for cls in registry]
    return plans


@pytest.mark.parametrize("plan", _every_strategy(), ids=lambda p: p.describe())
def test_round_trip(plan: Plan) -> None:
    data = json.loads(json.dumps(plan.to_dict()))
    again = Plan.from_dict(data)
    assert again == plan and again.digest() == plan.digest()
    assert type(again.checkpointing) is type(plan.checkpointing)


def test_digest_tells_plans_apart() -> None:
    digests = {p.digest() for p in _every_strategy()}
    assert len(digests) == len({json.dumps(p.to_dict(), sort_keys=True) for p in _every_strategy()})


@pytest.mark.parametrize("data", [{}, {"precision": {"name": "fp64"}}, {"world_size": 1}, []])
def test_not_a_plan(data: object) -> None:
    with pytest.raises(ValueError, match="not a memtrain plan"):
        Plan.from_dict(data)  # type: ignore[arg-type]


def test_plan_json_and_checkpoint_metadata_round_trip(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        strategies={"checkpointing": "fraction", "checkpointing_fraction": 0.5},
        batch={"global_size": 8, "micro_size": 4},
        checkpoint={"every": 2, "keep": 3},
    )
    trainer = CausalLMTrainer(recipe)
    trainer.fit()
    plan_json = json.loads((tmp_path / "run/plan.json").read_text())
    assert Plan.from_dict(plan_json["plan"]) == trainer.plan
    meta = json.loads((tmp_path / "run/checkpoints/step_00000002/meta.json").read_text())
    assert Plan.from_dict(meta["plan"]) == trainer.plan
    assert (
        isinstance(trainer.plan.checkpointing, FractionCheckpointing)
        and trainer.plan.checkpointing.fraction == 0.5
    )


def test_resume_keeps_a_micro_batch_recovery_lowered(tmp_path: Path) -> None:
    """The micro-batching saved with a checkpoint (here as an out-of-memory recovery would have left it)
    is what a resumed run continues with."""
    recipe = tiny_recipe(
        tmp_path, batch={"global_size": 8, "micro_size": 8}, checkpoint={"every": 2, "keep": 3}
    )
    first = CausalLMTrainer(recipe)
    first.setup()
    first.plan = first.plan.replace(micro_batching=MicroBatching(2, 4))
    first.fit()
    resumed = CausalLMTrainer(
        tiny_recipe(
            tmp_path,
            batch={"global_size": 8, "micro_size": 8},
            train={"steps": 6},
            checkpoint={"every": 2, "keep": 3},
        )
    )
    resumed.fit(resume=True)
    assert resumed.plan.micro_batching == MicroBatching(2, 4)
