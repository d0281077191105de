"""Bad sharding input is refused with a message naming the key to change; the DeepSpeed config is
generated from the plan and a contradicting user JSON is reported key by key."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import memtrain.strategies.sharding.sharded_checkpoint as sharded_checkpoint
from memtrain.checkpoint import CheckpointError
from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError, Unsupported
from memtrain.plan import is_open, pinned_plan
from memtrain.strategies.sharding import make_sharding
from memtrain.strategies.sharding.deepspeed_config import DeepSpeedPlan, build_config
from memtrain.training.deepspeed_checks import recipe_keys

from helpers import tiny_recipe

NEEDS_DEEPSPEED = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)
TWO_RANKS = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
PLAN = DeepSpeedPlan(
    stage=2,
    precision="bf16-mixed",
    offload="none",
    micro_batch_size=2,
    accumulation_steps=3,
    world_size=4,
    grad_clip=1.0,
    model_numel=1001,
)


@pytest.mark.parametrize(
    ("name", "options", "key"),
    [
        ("ddp", {"offload": "optimizer"}, "strategies.sharding_offload"),
        ("zero1", {"offload": "optimizer"}, "strategies.sharding_offload"),
        ("zero3", {"offload": "optimizer"}, "strategies.sharding_offload"),
        pytest.param(
            "zero2",
            {"offload": "params", "backend": "deepspeed"},
            "strategies.sharding_offload",
            marks=NEEDS_DEEPSPEED,
        ),
        ("zero3", {"comm_hook": "bf16"}, "strategies.comm_hook"),
        pytest.param(
            "zero2",
            {"comm_hook": "powersgd", "backend": "deepspeed"},
            "strategies.comm_hook",
            marks=NEEDS_DEEPSPEED,
        ),
        ("zero3", {"precision": "bf16-master"}, "strategies.precision"),
        ("zero1", {"precision": "bf16-master"}, "strategies.precision"),
        pytest.param(
            "zero2",
            {"precision": "fp16-mixed", "backend": "deepspeed"},
            "strategies.precision",
            marks=NEEDS_DEEPSPEED,
        ),
        pytest.param(
            "zero2",
            {"precision": "bf16-true", "backend": "deepspeed"},
            "strategies.precision",
            marks=NEEDS_DEEPSPEED,
        ),
    ],
)
def test_unsupported_combinations_name_the_key(name: str, options: dict[str, Any], key: str) -> None:
    with pytest.raises(Unsupported, match=key):
        make_sharding(name, **options).check(TWO_RANKS)


@NEEDS_DEEPSPEED
def test_supported_offloads_pass_their_check() -> None:
    make_sharding("zero3", offload="params").check(TWO_RANKS)
    make_sharding("zero2", offload="optimizer", backend="deepspeed").check(TWO_RANKS)
    make_sharding("zero3", offload="params", backend="deepspeed").check(TWO_RANKS)


def test_missing_deepspeed_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    with pytest.raises(Unsupported, match=r"pip install 'memtrain\[deepspeed\]'"):
        make_sharding("zero3", backend="deepspeed").check(TWO_RANKS)


def test_world_size_not_dividing_the_global_batch(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, strategies={"sharding": "zero3"})  # global batch 8
    with pytest.raises(RecipeError, match="batch.global_size"):
        pinned_plan(recipe, DistEnv(rank=0, world_size=3, local_rank=0, device=torch.device("cpu")))


@NEEDS_DEEPSPEED
def test_recipe_options_reach_the_backend(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        batch={"global_size": 8, "micro_size": 2},
        strategies={
            "sharding": "zero2",
            "sharding_backend": "deepspeed",
            "sharding_offload": "optimizer",
            "precision": "fp32",
        },
    )
    backend = pinned_plan(recipe, TWO_RANKS).sharding_backend()
    assert type(backend).__name__ == "DeepSpeedBackend"
    config = backend.config(model_numel=1000, world_size=2)  # type: ignore[attr-defined]
    assert config["gradient_accumulation_steps"] == 2 and config["train_batch_size"] == 8
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_unknown_sharding_option_value_is_a_recipe_error(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="strategies.sharding_backend.*fsdp2"):
        tiny_recipe(tmp_path, strategies={"sharding": "zero3", "sharding_backend": "fsdp"})


# ----------------------------------------------------------------------------------- DeepSpeed JSON


def test_generated_config_follows_the_plan() -> None:
    config = build_config(PLAN)
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 2 * 3 * 4
    assert config["gradient_clipping"] == 1.0
    assert config["bf16"] == {"enabled": True} and config["fp16"] == {"enabled": False}
    zero = config["zero_optimization"]
    assert zero["stage"] == 2 and zero["offload_optimizer"] == {"device": "none"}
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 1002  # capped at the model, even


def test_user_json_tunes_what_the_plan_does_not_own() -> None:
    user = {
        "zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 64},
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": True},
    }
    config = build_config(PLAN, user)
    assert config["zero_optimization"]["overlap_comm"] is True
    assert config["zero_optimization"]["reduce_bucket_size"] == 64
    assert config["gradient_accumulation_steps"] == 3


def test_contradicting_user_json_lists_every_key() -> None:
    user = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "Adam"},
    }
    with pytest.raises(RecipeError) as caught:
        build_config(PLAN, user)
    problems = caught.value.problems
    for key in (
        "train_micro_batch_size_per_gpu",
        "gradient_clipping",
        "bf16.enabled",
        "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device",
        "'optimizer'",
    ):
        assert any(key in line for line in problems), key
    assert len(problems) == 6


@NEEDS_DEEPSPEED
def test_backend_reads_the_users_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    backend = make_sharding("zero3", backend="deepspeed", deepspeed_config=str(path))
    with pytest.raises(RecipeError, match=r"zero_optimization.stage=1 contradicts"):
        backend.config(model_numel=10, world_size=2)  # type: ignore[attr-defined]
    path.write_text("{not json")
    with pytest.raises(RecipeError, match="strategies.deepspeed_config: .* is not valid JSON"):
        backend.check(TWO_RANKS)


def test_checkpoint_formats_do_not_mix(tmp_path: Path) -> None:
    (tmp_path / "deepspeed").mkdir()
    with pytest.raises(CheckpointError, match="sharding_backend=deepspeed"):
        sharded_checkpoint.load_sharded(tmp_path, torch.nn.Linear(2, 2), torch.optim.SGD([torch.zeros(1)]))
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        sharded_checkpoint.detect_format(tmp_path / "nothing")


@pytest.mark.parametrize(
    ("offload", "expected"),
    [("none", "none"), ("optimizer", "cpu"), ("params", "cpu"), ("auto", None), (["none", "params"], None)],
)
def test_recipe_decides_the_offload_device_only_when_it_pins_the_offload(
    tmp_path: Path, offload: Any, expected: str | None
) -> None:
    """An open offload (`auto` or a list) is the planner's choice: a user JSON's offload device cannot
    contradict it before there is a plan, and the recipe is open even if everything else is pinned."""
    recipe = tiny_recipe(
        tmp_path,
        strategies={"sharding": "zero3", "sharding_backend": "deepspeed", "sharding_offload": offload},
    )
    keys = recipe_keys(recipe)
    assert keys.get("zero_optimization.offload_optimizer.device") == expected
    assert keys.get("zero_optimization.offload_param.device") == (
        None if expected is None else "cpu" if offload == "params" else "none"
    )
    assert is_open(recipe) == (expected is None)
