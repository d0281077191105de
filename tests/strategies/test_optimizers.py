"""Each optimizer a recipe may name (`optimizer.name`: adafactor, lion, galore; AdamW with torchao's 4-bit
states, `strategies.optimizer_states: 4bit`): its state bytes predicted to the byte against the memory
tracker, the loss falls on the default recipe's model, and a resume continues bit for bit.

The hole: AdamW was the only optimizer memtrain could train with or plan (the recipe had no `optimizer:`
section and `optimizer_states` no 4bit), so every case here failed at the recipe before this change; and
galore-torch keeps its projections in Python objects, which neither the tracker nor a `weights_only`
checkpoint can see (the bytes and resume tests of galore fail without `memtrain.strategies.galore`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError, Unsupported
from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo
from memtrain.planner.states import optimizer_cost
from memtrain.strategies.blocks import model_shape
from memtrain.strategies.optimizer import OPTIMIZER_STATES, measured_state_bytes
from memtrain.strategies.optimizers import OPTIMIZERS, AdafactorStates
from memtrain.strategies.sharding import SHARDING

from helpers import REPO, TINY_LLAMA, tiny_recipe

# Wide enough that torchao quantises most tensors (>= 4096 elements) and GaLore's rank 8 projects.
MODEL = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}

HAS_GALORE = True
try:
    import galore_torch  # noqa: F401
except ImportError:
    HAS_GALORE = False
NEEDS_GALORE = pytest.mark.skipif(not HAS_GALORE, reason="galore-torch is not installed (memtrain[galore])")
NEEDS_TORCHAO = pytest.mark.skipif(  # scripts/gpu_check.sh installs neither on a GPU machine
    importlib.util.find_spec("torchao") is None, reason="torchao is not installed (memtrain[fp8])"
)

# (optimizer.name, strategies.optimizer_states, train.lr that moves the default model in a few steps)
CASES = [
    pytest.param("adafactor", "fp32", 0.5, id="adafactor"),
    pytest.param("lion", "fp32", 1e-3, id="lion"),
    pytest.param("galore", "fp32", 1e-2, id="galore", marks=NEEDS_GALORE),
    pytest.param("adamw", "4bit", 3e-3, id="adamw-4bit", marks=NEEDS_TORCHAO),
]
OPTIMIZER = {"galore_rank": 8, "galore_update_proj_gap": 4}  # resumed at 2: reuses the saved projection


@pytest.mark.gpu  # also in scripts/gpu_check.sh: on a GPU the trainer runs each optimizer's CUDA kernels
@pytest.mark.parametrize(("name", "states", "lr"), CASES)
def test_state_bytes_match_the_tracker(tmp_path: Path, name: str, states: str, lr: float) -> None:
    recipe = tiny_recipe(
        tmp_path,
        model={"config": MODEL},
        train={"steps": 2, "lr": lr},
        memory={"track": True},
        optimizer={**OPTIMIZER, "name": name},
        strategies={"optimizer_states": states},
    )
    trainer = CausalLMTrainer(recipe)
    trainer.fit()
    model = trainer.sharding.unwrap(trainer.model)
    shape = model_shape(model, trainer.blocks(model))
    predicted = trainer.plan.update_states.estimate(
        shape, trainer.plan.precision.estimate(shape, Footprint())
    )
    measured = trainer.monitor.memory_reports[-1].component_peaks
    assert trainer.optimizer is not None
    assert (
        measured["optimizer_states"] == predicted.optimizer_states == measured_state_bytes(trainer.optimizer)
    )
    assert measured["weights"] == predicted.weights
    assert measured["gradients"] == predicted.gradients
    adamw = 2 * shape.numel * 4 + 4 * len(shape.params)
    assert predicted.optimizer_states < adamw * 0.6, (name, predicted.optimizer_states, adamw)


def default_model_recipe(tmp_path: Path, name: str, states: str, lr: float, steps: int) -> Any:
    """The default recipe's model and data, a short sequence and a small batch, one learning rate."""
    default = yaml.safe_load((REPO / "recipes/default.yaml").read_text())
    return tiny_recipe(
        tmp_path,
        model={"config": default["model"]["config"]},
        data={
            "source": "text",
            "path": str(REPO / "data/tiny_corpus.txt"),
            "tokenizer": "byte",
            "seq_len": 32,
        },
        batch={"global_size": 4, "micro_size": 4},
        train={"steps": steps, "lr": lr, "schedule": "constant", "weight_decay": 0.1},
        checkpoint={"every": 2, "at_end": True},
        optimizer={**OPTIMIZER, "name": name},
        strategies={"optimizer_states": states},
    )


@pytest.mark.parametrize(("name", "states", "lr"), CASES)
def test_loss_falls_and_a_resume_is_exact(tmp_path: Path, name: str, states: str, lr: float) -> None:
    def run(where: str, steps: int, resume: bool = False) -> Any:
        recipe = default_model_recipe(tmp_path / where, name, states, lr, steps)
        return CausalLMTrainer(recipe).fit(resume=resume)

    straight = run("straight", 4)
    assert sum(straight.losses[-2:]) / 2 < straight.losses[0] - 0.1, straight.losses
    run("resumed", 2)
    assert run("resumed", 4, resume=True).losses == straight.losses[2:]


def test_the_planner_chooses_only_among_the_listed_optimizers(tmp_path: Path) -> None:
    """A list is the planner's to choose from, a single name (the default: adamw) is kept: the optimizer
    changes the training, so the planner never offers one the recipe does not list."""
    sections: dict[str, Any] = {
        "strategies": {"optimizer_states": "fp32", "checkpointing": "none", "sharding": "none"},
        "batch": {"global_size": 2, "micro_size": "auto"},
    }

    def offered(trainer: CausalLMTrainer) -> set[str]:
        result = trainer.choose_plan()
        return {s.plan.optimizer.name for s in (*result.ranked, *result.infeasible)}

    listed = CausalLMTrainer(tiny_recipe(tmp_path / "a", optimizer={"name": ["adamw", "lion"]}, **sections))
    assert offered(listed) == {"adamw", "lion"}
    alone = CausalLMTrainer(tiny_recipe(tmp_path / "b", **sections))
    assert offered(alone) == {"adamw"}


def test_auto_and_unknown_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="optimizer.name"):
        tiny_recipe(tmp_path, optimizer={"name": "auto"})
    with pytest.raises(RecipeError, match="optimizer.name.*lion"):
        tiny_recipe(tmp_path, optimizer={"name": "loin"})


def test_where_an_optimizer_cannot_run_the_keys_are_named() -> None:
    lion, adafactor = OPTIMIZERS.create("lion"), OPTIMIZERS.create("adafactor")
    fp32, none = OPTIMIZER_STATES.create("fp32"), SHARDING.create("none")
    deepspeed = SHARDING.create("zero2", {"sharding_backend": "deepspeed"})
    with pytest.raises(Unsupported, match="optimizer.name: lion .*strategies.sharding_backend=fsdp2"):
        lion.check_with(fp32, deepspeed)
    with pytest.raises(Unsupported, match="optimizer.name: adafactor .*strategies.sharding=zero3"):
        adafactor.check_with(fp32, SHARDING.create("zero3"))
    with pytest.raises(Unsupported, match="strategies.optimizer_states: bf16 .*optimizer.name"):
        lion.check_with(OPTIMIZER_STATES.create("bf16"), none)
    with pytest.raises(Unsupported, match="strategies.optimizer_states: 4bit .*strategies.sharding=zero1"):
        OPTIMIZERS.create("adamw").check_with(OPTIMIZER_STATES.create("4bit"), SHARDING.create("zero1"))
    with pytest.raises(Unsupported, match="strategies.optimizer_step: in_backward .*optimizer.name galore"):
        OPTIMIZERS.create("galore").check_with(fp32, none, in_backward=True)
    lion.check_with(fp32, SHARDING.create("zero3"))  # elementwise: FSDP2's row shards step as they are
    adafactor.check_with(fp32, SHARDING.create("zero1"))  # whole tensors per rank


def test_galore_keeps_its_projection_compact() -> None:
    """galore-torch keeps `Vh[:rank]`, a view holding the whole square SVD factor alive."""
    if not HAS_GALORE:
        pytest.skip("galore-torch is not installed (memtrain[galore])")
    from memtrain.strategies.galore import TrackedGaLoreAdamW, galore_groups

    weight = torch.nn.Parameter(torch.randn(64, 32))
    optimizer = TrackedGaLoreAdamW(galore_groups([weight], 4, 10, 0.25), lr=0.1)
    weight.grad = torch.randn(64, 32)
    optimizer.step()
    ortho = optimizer.state[weight]["ortho_matrix"]
    assert ortho.shape == (4, 32)
    assert ortho.untyped_storage().nbytes() == 4 * 32 * 4


def test_zero1_takes_shape_dependent_states_tensor_by_tensor() -> None:
    """zero1 gives each rank whole tensors. Adafactor's bytes follow each tensor's shape, so a per-element
    average of them (what `OptimizerCost` carried) put too few bytes on the rank holding a vector, whose
    states are whole: here 8,650 predicted for 16,004 kept."""
    shape = ModelShape(
        (ParamInfo("embed", 4096, None, dims=(256, 16)), ParamInfo("norm", 4000, None, dims=(4000,))), 0
    )
    backend = SHARDING.create("zero1").build("fp32")
    per_rank = backend.state_bytes(shape, 2, optimizer_cost(shape, AdafactorStates()))
    assert per_rank.optimizer_states == max((256 + 16) * 4 + 4, 4000 * 4 + 4)
