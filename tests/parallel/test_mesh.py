"""Meshes (`strategies.mesh`): HSDP, tensor and sequence parallel, FSDP x TP, against one process.

Each multi-rank job trains the tiny recipe (or a `Trainer` subclass with its own tensor-parallel plan) for
3 steps with accumulation and must end where the same job ends on one process: the losses and the whole
weights within fp32 tolerance. One torchrun launch of 4 ranks runs the 4-rank jobs in sequence
(`mesh_jobs.py`), one of 2 ranks the pure tensor-parallel ones.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError
from memtrain.mesh import MeshShape, resolve
from memtrain.plan import Plan, mesh_of

from helpers import tiny_recipe, tiny_recipe_dict

sys.path.insert(0, str(Path(__file__).parent))
from mesh_jobs import launch, whole_weights  # noqa: E402
from mesh_trainers import SplitMLPTrainer  # noqa: E402

TINY_QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
STEPS = {"train": {"steps": 3}}
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 2e-5  # fp32 after 3 AdamW steps at lr 1e-2 (measured: <= 4e-6)


def _job(tmp: Path, name: str, mesh: dict[str, Any], micro: int, **extra: Any) -> dict[str, Any]:
    sharding = extra.pop("sharding", "zero3")
    sections = {
        "strategies": {"sharding": sharding, "mesh": mesh},
        "batch": {"global_size": 8, "micro_size": micro},
        **STEPS,
        **extra.pop("sections", {}),
    }
    return {"run_dir": str(tmp / name), "weights_out": str(tmp / f"{name}.pt"), "sections": sections, **extra}


FOUR_RANKS = {  # name -> (mesh, micro-batch size, model config or trainer)
    "hsdp_2x2": ({"dp_replicate": 2, "dp_shard": 2}, 1, None),
    "fsdp_x_tp_sp": ({"dp_shard": 2, "tp": 2}, 2, None),
    "fsdp_x_tp_qwen2": ({"dp_shard": 2, "tp": 2, "sequence_parallel": False}, 2, TINY_QWEN2),
    "fsdp_x_tp_subclass": ({"dp_shard": 2, "tp": 2}, 2, "SplitMLPTrainer"),
}
TWO_RANKS = {
    "tp_sp": ({"tp": 2}, 4, None),
    "tp_no_sp": ({"tp": 2, "sequence_parallel": False}, 4, None),
}


def _jobs(tmp: Path, table: dict[str, Any]) -> list[dict[str, Any]]:
    jobs = []
    for name, (mesh, micro, model) in table.items():
        extra: dict[str, Any] = {"sharding": "none" if "dp_shard" not in mesh else "zero3"}
        if isinstance(model, dict):
            extra["sections"] = {"model": {"config": model}}
        elif isinstance(model, str):
            extra["trainer"] = model
        if name == "fsdp_x_tp_sp":
            extra["sections"] = {"memory": {"track": True}}
        jobs.append(_job(tmp, name, mesh, micro, **extra))
    return jobs


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("mesh")
    results = {}
    for ranks, table in ((4, FOUR_RANKS), (2, TWO_RANKS)):
        for name, result in zip(table, launch(tmp, ranks, _jobs(tmp, table)), strict=True):
            results[name] = result
    return tmp, results


def _reference(tmp: Path, micro: int, model: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same job on one process, no mesh."""
    sections: dict[str, Any] = {"batch": {"global_size": 8, "micro_size": micro}, **STEPS}
    if isinstance(model, str):
        raw = tiny_recipe_dict(tmp, **sections)
        trainer: Any = SplitMLPTrainer(
            SplitMLPTrainer.recipe_class.from_dict(
                {k: v for k, v in raw.items() if k not in ("model", "data")}
            )
        )
    else:
        if isinstance(model, dict):
            sections["model"] = {"config": model}
        trainer = CausalLMTrainer(tiny_recipe(tmp, **sections))
    result = trainer.fit()
    return result.losses, whole_weights(trainer)


@pytest.mark.parametrize("name", [*FOUR_RANKS, *TWO_RANKS])
def test_mesh_trains_as_one_process(
    name: str, mesh_runs: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    """HSDP, tensor parallel with and without sequence parallel, FSDP x TP (two transformers families and a
    subclass with its own plan): equal losses and weights after 3 AdamW steps with accumulation. The hole it
    closes: before meshes every rank was a data-parallel rank (a tp rank would read other rows, and a
    sharding over all ranks would average tensor-parallel shards as if they were replicas)."""
    tmp, results = mesh_runs
    _, micro, model = {**FOUR_RANKS, **TWO_RANKS}[name]
    losses, expected = _reference(tmp_path, micro, model)
    got = torch.load(tmp / f"{name}.pt")
    assert results[name]["losses"] == pytest.approx(losses, abs=LOSS_TOLERANCE)
    assert set(got) == set(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= WEIGHT_TOLERANCE, (name, worst)


def test_each_rank_holds_its_share_of_the_states(mesh_runs: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    """FSDP 2 x TP 2: each rank's matmul weights and AdamW states are 1/(t*d) of the model's, the norms
    1/d (replicated over tensor ranks), the embedding split by vocabulary like the head, in storages of
    exactly those bytes; the tracker counts those optimizer states to the byte. The hole: while FSDP2 had a
    group gathered, the tracker took its sharded parameters for master copies (optimizer states)."""
    _, results = mesh_runs
    ranks = results["fsdp_x_tp_sp"]["ranks"]
    model = CausalLMTrainer(tiny_recipe(Path("/nonexistent"))).build_model()
    whole = {n: p.numel() * 4 for n, p in model.named_parameters()}
    for rank in ranks:
        held = {
            k.removeprefix("param:").replace("_checkpoint_wrapped_module.", ""): v
            for k, v in rank["bytes"].items()
            if k.startswith("param:")
        }
        for name, size in whole.items():
            divisor = 2 if "norm" in name else 4  # norms: FSDP's d only; matmuls and embeddings: t * d
            assert held[name] == size // divisor, (rank["coordinates"], name, held[name], size)
        assert rank["bytes"]["optimizer"] == 2 * sum(held.values())  # AdamW's two moments of each shard
        assert rank["bytes"]["optimizer_storage"] == rank["bytes"]["optimizer"]  # no padded storage
        assert rank["bytes"]["param_storage"] == sum(held.values())
        steps = 4 * len(held)  # AdamW's step counter per tensor: a 0-dim fp32 tensor
        assert rank["tracked"]["optimizer_states"] == rank["bytes"]["optimizer"] + steps
        assert rank["tracked"]["weights"] >= sum(held.values())  # plus what FSDP has gathered at the peak


def test_mesh_resolves_degrees() -> None:
    """`auto` takes the ranks the pinned degrees leave; coordinates put tensor ranks innermost."""
    assert resolve({"dp_shard": "auto", "tp": 2}, 8) == MeshShape(dp_shard=4, tp=2)
    assert resolve({"dp_replicate": 2, "dp_shard": "auto"}, 8) == MeshShape(dp_replicate=2, dp_shard=4)
    assert resolve({"dp_shard": 2, "tp": "auto"}, 8) == MeshShape(dp_shard=2, tp=4)
    mesh = MeshShape(dp_replicate=2, dp_shard=2, tp=2)
    assert [mesh.coordinates(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [mesh.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert mesh.batch_copies == 2 and mesh.dp_size == 4
    with pytest.raises(ValueError, match="strategies.mesh: the pinned degrees"):
        resolve({"dp_shard": "auto", "tp": 3}, 8)
    with pytest.raises(ValueError, match="multiply to 4"):
        resolve({"dp_shard": 2, "tp": 2}, 8)
    assert Plan.from_dict({**_plan_dict(), "mesh": mesh.to_dict()}).mesh == mesh
    with pytest.raises(ValueError, match="not a memtrain plan"):
        Plan.from_dict({**_plan_dict(), "mesh": {"tp": 0}})


def _plan_dict() -> dict[str, Any]:
    from memtrain.distributed import one_process
    from memtrain.plan import pinned_plan
    from memtrain.planner import stderr_progress  # noqa: F401  (the planner's registries)

    return pinned_plan(tiny_recipe(Path("/nonexistent")), one_process()).to_dict()


@pytest.mark.parametrize(
    ("world", "strategies", "config", "expected"),
    [
        (4, {"mesh": {"cp": 2}}, None, "strategies.mesh.cp: 2 ranks of context parallelism: torch has no"),
        (4, {"mesh": {"pp": 2}}, None, "strategies.mesh.pp: 2 pipeline stages"),
        (4, {"mesh": {"dp_shard": 3}}, None, "strategies.mesh: the pinned degrees"),
        (4, {"mesh": {"tp": 2}, "sharding": "ddp"}, None, "strategies.sharding: ddp replicates whole"),
        (
            4,
            {"mesh": {"dp_replicate": 2}, "sharding": "zero3", "sharding_backend": "deepspeed"},
            None,
            "DeepSpeed runs",
        ),
        (
            2,
            {"mesh": {"tp": 2}},
            {**TINY_QWEN2, "num_key_value_heads": 1},
            "does not divide the model's num_key_value",
        ),
        (2, {"mesh": {"tp": 2}}, {**TINY_QWEN2, "tie_word_embeddings": True}, "ties its input and output"),
        (2, {"mesh": {"tp": 2}, "loss": "chunked"}, None, "strategies.loss: chunked applies the output head"),
    ],
)
def test_validate_reports_each_mesh_problem(
    world: int,
    strategies: dict[str, Any],
    config: dict[str, Any] | None,
    expected: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every mesh problem `train` would stop on is one line of `validate` (the recipe problems it runs)."""
    from memtrain.commands.trainers import recipe_problems

    monkeypatch.setenv("WORLD_SIZE", str(world))
    sections: dict[str, Any] = {"strategies": {"sharding": "zero3", **strategies}}
    if config is not None:
        sections["model"] = {"config": config}
    recipe = CausalLMRecipe.from_dict(tiny_recipe_dict(tmp_path, **sections))
    problems = recipe_problems(recipe, CausalLMTrainer)
    assert any(expected in line for line in problems), problems


def test_a_trainer_without_a_plan_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mesh_trainers import NoPlanTrainer

    from memtrain.commands.trainers import recipe_problems

    monkeypatch.setenv("WORLD_SIZE", "2")
    raw = tiny_recipe_dict(tmp_path, strategies={"mesh": {"tp": 2}})
    recipe = NoPlanTrainer.recipe_class.from_dict(
        {k: v for k, v in raw.items() if k not in ("model", "data")}
    )
    assert any(
        "NoPlanTrainer has no tensor-parallel plan" in p for p in recipe_problems(recipe, NoPlanTrainer)
    )
    assert not recipe_problems(recipe, SplitMLPTrainer)


def test_mesh_of_names_the_key(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, strategies={"mesh": {"tp": 3}})
    with pytest.raises(RecipeError, match="strategies.mesh"):
        mesh_of(recipe, 4)


@pytest.mark.slow
def test_hsdp_x_tp_on_eight_ranks_trains_as_one_process(tmp_path: Path) -> None:
    """The 3-D case: 2 replicas x 2 shards x 2 tensor ranks (sequence parallel), 8 processes; the tensor
    ranks of one data-parallel rank read the same rows, each replica x shard its own."""
    mesh = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    (result,) = _launch(tmp_path, 8, [_job(tmp_path, "hsdp_x_tp", mesh, 1)])
    losses, expected = _reference(tmp_path / "reference", 1, None)
    got = torch.load(tmp_path / "hsdp_x_tp.pt")
    assert result["losses"] == pytest.approx(losses, abs=LOSS_TOLERANCE)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= WEIGHT_TOLERANCE
    assert [r["coordinates"]["tp"] for r in result["ranks"]] == [0, 1] * 4


def test_the_mesh_line_names_the_dimensions_that_cross_nodes() -> None:
    """torchrun puts consecutive ranks on one node: with 4 per node, HSDP 2 x 2 keeps shards within a node
    and replicas across; tensor parallel over 8 ranks would cross (said, not refused)."""
    assert MeshShape(dp_replicate=2, dp_shard=2, tp=2).crossing(4) == ["dp_replicate"]
    assert MeshShape(dp_shard=2, tp=8).crossing(4) == ["dp_shard", "tp"]
    assert MeshShape(pp=2, dp_shard=4).crossing(4) == ["pp"]
    assert MeshShape(dp_shard=8).crossing(8) == []
