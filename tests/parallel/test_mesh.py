"""Meshes (`strategies.mesh`): HSDP, tensor and sequence parallel, FSDP x TP, against one process.

Each multi-rank job trains the tiny recipe (or a `Trainer` subclass with its own tensor-parallel plan) for
3 steps with accumulation and must end where the same job ends on one process: the losses and the whole
weights within fp32 tolerance. One torchrun launch of 4 ranks runs the 4-rank jobs in sequence
(`mesh_jobs.py`), one of 2 ranks the pure tensor-parallel ones.
"""

from __future__ import annotations

import shutil
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

from helpers import TINY_LLAMA, tiny_recipe, tiny_recipe_dict

sys.path.insert(0, str(Path(__file__).parent))
from mesh_jobs import launch, whole_weights  # noqa: E402
from mesh_trainers import SplitMLPTrainer  # noqa: E402

TINY_QWEN2 = {**TINY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": False}
STEPS = {"train": {"steps": 3}}
LOSS_TOLERANCE = 1e-5
WEIGHT_TOLERANCE = 2e-5  # fp32 after 3 AdamW steps at lr 1e-2 (measured: <= 4e-6)


CLIPPED = {"pp_gpipe", "pp_1f1b", "pp_x_dp", "pp_from_one"}
"""Jobs clipped at a norm below every step's (0.05): the norm must be summed over the pipeline's stages."""
CHECKPOINTED = {"pp_1f1b": 2, "pp_from_one": 2}  # a checkpoint after this step: the resume tests'
RESUMED = {"pp_from_one"}  # resumes the fixture's one-process run (`test_a_one_process_run_resumes_on_...`)


def _sections(name: str) -> dict[str, Any]:
    """`train` (and `checkpoint`) of job `name`, as its one-process reference runs it too."""
    clip = {"grad_clip": 0.05} if name in CLIPPED else {}
    every = {"checkpoint": {"every": CHECKPOINTED[name]}} if name in CHECKPOINTED else {}
    return {"train": {**STEPS["train"], **clip}, **every}


def _job(tmp: Path, name: str, mesh: dict[str, Any], micro: int, **extra: Any) -> dict[str, Any]:
    sharding = extra.pop("sharding", "zero3")
    sections = {
        "strategies": {"sharding": sharding, "mesh": mesh},
        "batch": {"global_size": 8, "micro_size": micro},
        **_sections(name),
        **extra.pop("sections", {}),
    }
    return {"run_dir": str(tmp / name), "weights_out": str(tmp / f"{name}.pt"), "sections": sections, **extra}


FOUR_RANKS = {  # name -> (mesh, micro-batch size, model config or trainer)
    "hsdp_2x2": ({"dp_replicate": 2, "dp_shard": 2}, 1, None),
    "fsdp_x_tp_sp": ({"dp_shard": 2, "tp": 2}, 2, None),
    "fsdp_x_tp_qwen2": ({"dp_shard": 2, "tp": 2, "sequence_parallel": False}, 2, TINY_QWEN2),
    "fsdp_x_tp_subclass": ({"dp_shard": 2, "tp": 2}, 2, "SplitMLPTrainer"),
    "pp_x_dp": ({"pp": 2, "dp_shard": 2}, 2, None),
    "fsdp_x_cp": ({"dp_shard": 2, "cp": 2}, 2, None),  # the ring: tests/parallel/ring_standin.py
}
TWO_RANKS = {
    "tp_sp": ({"tp": 2}, 4, None),
    "tp_no_sp": ({"tp": 2, "sequence_parallel": False}, 4, None),
    "pp_gpipe": ({"pp": 2, "pp_schedule": "gpipe"}, 2, None),
    "pp_1f1b": ({"pp": 2, "pp_schedule": "1f1b"}, 2, None),
    "pp_from_one": ({"pp": 2}, 2, None),
}


def _jobs(tmp: Path, table: dict[str, Any]) -> list[dict[str, Any]]:
    jobs = []
    for name, (mesh, micro, model) in table.items():
        replicated = "dp_shard" not in mesh and "pp" not in mesh  # pipeline stages save through FSDP2's DCP
        extra: dict[str, Any] = {"sharding": "none" if replicated else "zero3"}
        if isinstance(model, dict):
            extra["sections"] = {"model": {"config": model}}
        elif isinstance(model, str):
            extra["trainer"] = model
        if name == "fsdp_x_tp_sp":
            extra["sections"] = {"memory": {"track": True}}
        if name in RESUMED:
            extra["resume"] = True
        if "cp" in mesh:
            extra["ring_standin"] = True
        jobs.append(_job(tmp, name, mesh, micro, **extra))
    return jobs


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("mesh")
    losses, weights = _on_one_process(tmp / "pp_from_one", "pp_from_one")  # what the pp job resumes
    torch.save(weights, tmp / "one_process.pt")
    results: dict[str, dict[str, Any]] = {"one_process": {"losses": losses}}
    for ranks, table in ((4, FOUR_RANKS), (2, TWO_RANKS)):
        for name, result in zip(table, launch(tmp, ranks, _jobs(tmp, table)), strict=True):
            results[name] = result
    return tmp, results


def _on_one_process(
    run_dir: Path, name: str, resume: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Pipeline job `name` on one process under FSDP2 (the DCP checkpoints a pipeline run writes): losses
    and whole weights."""
    sections = {
        "batch": {"global_size": 8, "micro_size": 2},
        "strategies": {"sharding": "zero3"},
        **_sections(name),
    }
    trainer = CausalLMTrainer(tiny_recipe(run_dir, **sections))
    result = trainer.fit(resume=resume)
    weights = whole_weights(trainer)
    trainer.close()
    return result.losses, weights


def _reference(
    tmp: Path, micro: int, model: Any, name: str = ""
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same job (`name`'s, when given) on one process, no mesh."""
    sections: dict[str, Any] = {"batch": {"global_size": 8, "micro_size": micro}, **_sections(name)}
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


@pytest.mark.parametrize("name", [n for n in [*FOUR_RANKS, *TWO_RANKS] if n not in RESUMED])
def test_mesh_trains_as_one_process(
    name: str, mesh_runs: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    """HSDP, tensor parallel with and without sequence parallel, FSDP x TP (two transformers families and a
    subclass with its own plan), a 2-stage pipeline (GPipe, 1F1B, and x FSDP 2), FSDP x context parallel
    (attention through tests/parallel/ring_standin.py on CPU): equal losses and weights
    after 3 AdamW steps with accumulation. The hole it closes: before meshes every rank was a data-parallel
    rank (a tp rank would read other rows, and a sharding over all ranks would average tensor-parallel shards
    as if they were replicas); before the pipeline, `strategies.mesh.pp > 1` was refused, and a stage's
    gradient norm alone (torch's `clip_grad_norm_`) clips each stage by another factor (the pp jobs clip)."""
    tmp, results = mesh_runs
    _, micro, model = {**FOUR_RANKS, **TWO_RANKS}[name]
    losses, expected = _reference(tmp_path, micro, model, name)
    got = torch.load(tmp / f"{name}.pt")
    assert results[name]["losses"] == pytest.approx(losses, abs=LOSS_TOLERANCE)
    assert set(got) == set(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= WEIGHT_TOLERANCE, (name, worst)


def test_context_parallel_ranks_attend_with_half_the_queries(
    mesh_runs: tuple[Path, dict[str, dict[str, Any]]],
) -> None:
    """FSDP 2 x CP 2 (it trains as one process: `test_mesh_trains_as_one_process[fsdp_x_cp]`): every rank ran
    its attention with half of each row's columns as queries against the whole row's keys, so the rows were
    split and not computed twice (which would train alike too: the tokens and the averaging both double).
    The hole: `strategies.mesh.cp` was refused everywhere ("plans context parallelism but does not apply it
    yet")."""
    _, results = mesh_runs
    ranks = results["fsdp_x_cp"]["ranks"]
    assert {r["mesh"]["cp"] for r in ranks} == {2}
    for rank in ranks:
        assert rank["ring"] and all(2 * local == whole for local, whole in rank["ring"]), rank["ring"]
        assert rank["plan"]["sharding"].startswith("zero3")


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
        (
            4,
            {"mesh": {"cp": 2, "tp": 2}},
            None,
            "strategies.mesh.cp: 2 context-parallel ranks with strategies",
        ),
        (
            2,
            {"mesh": {"cp": 2}, "sharding": "ddp"},
            None,
            "does not reduce gradients over the context-parallel",
        ),
        (2, {"mesh": {"cp": 2}}, {"attn_implementation": "eager"}, "context parallelism runs torch's SDPA"),
        (3, {"mesh": {"pp": 3}}, None, "strategies.mesh.pp: 3 stages do not divide the model's num_hidden"),
        (4, {"mesh": {"pp": 2, "tp": 2}}, None, "strategies.mesh.pp: 2 pipeline stages with tensor parallel"),
        (2, {"mesh": {"pp": 2, "pp_schedule": "interleaved_1f1b"}}, None, "pp_schedule: interleaved_1f1b"),
        (2, {"mesh": {"pp": 2}, "sharding": "none"}, None, "strategies.sharding: none with pipeline stages"),
        (2, {"mesh": {"pp": 2}}, {**TINY_QWEN2, "tie_word_embeddings": True}, "the first and the last stage"),
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
    if config is not None:  # a model config, or a `model` key
        sections["model"] = config if "attn_implementation" in config else {"config": config}
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
    staged = NoPlanTrainer.recipe_class.from_dict({**recipe.to_dict(), "strategies": {"mesh": {"pp": 2}}})
    assert any(  # the pipeline split is the built-in causal-LM trainer's alone
        "SplitMLPTrainer cannot split its model into pipeline stages" in p
        for p in recipe_problems(staged, SplitMLPTrainer)
    )


def test_mesh_of_names_the_key(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, strategies={"mesh": {"tp": 3}})
    with pytest.raises(RecipeError, match="strategies.mesh"):
        mesh_of(recipe, 4)


def test_expert_parallelism_borrows_ranks_from_the_shard_group(tmp_path: Path) -> None:
    """`ep` splits the shard group (not the world): it must divide dp_shard, and the rest share each expert."""
    mesh = resolve({"dp_shard": "auto"}, 8, ep=4)
    assert mesh.size == 8 and mesh.ep == 4 and mesh.expert_shards == 2
    assert mesh.describe() == "dp_shard 8 (ep 4)"
    assert MeshShape.from_dict(mesh.to_dict()) == mesh
    with pytest.raises(ValueError, match="strategies.mesh.ep: 3"):
        resolve({"dp_shard": "auto"}, 8, ep=3)
    with pytest.raises(RecipeError, match="strategies.mesh.ep: 3 expert-parallel ranks do not divide"):
        mesh_of(tiny_recipe(tmp_path, strategies={"mesh": {"ep": 3}}), 4)
    assert mesh_of(tiny_recipe(tmp_path, strategies={"mesh": {"ep": 2}}), 4).ep == 2
    assert mesh_of(tiny_recipe(tmp_path, strategies={"mesh": {"ep": "auto"}}), 4).ep == 1


@pytest.mark.slow
def test_hsdp_x_tp_on_eight_ranks_trains_as_one_process(tmp_path: Path) -> None:
    """The 3-D case: 2 replicas x 2 shards x 2 tensor ranks (sequence parallel), 8 processes; the tensor
    ranks of one data-parallel rank read the same rows, each replica x shard its own."""
    mesh = {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    (result,) = launch(tmp_path, 8, [_job(tmp_path, "hsdp_x_tp", mesh, 1)])
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


def test_a_pipeline_run_resumes_on_one_process(
    mesh_runs: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    """The 2-stage 1F1B run's checkpoint after step 2 (each stage saved its own parameters and AdamW states
    under their whole-model names) resumes on one process: step 3's loss and the weights after it are those
    of the uninterrupted one-process run. The hole: before, nothing split a model into stages to save."""
    tmp, results = mesh_runs
    shutil.copytree(tmp / "pp_1f1b", tmp_path / "resumed")
    losses, got = _on_one_process(tmp_path / "resumed", "pp_1f1b", resume=True)
    _same_run(losses, got, results["one_process"]["losses"][2:], torch.load(tmp / "one_process.pt"))


def test_a_one_process_run_resumes_on_a_pipeline(mesh_runs: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    """The reverse: a one-process run's checkpoint after step 2 resumes on 2 stages (each loads its own
    parameters and states by their whole-model names), and step 3's loss and weights are that run's. The
    hole: before, `strategies.mesh.pp > 1` was refused."""
    tmp, results = mesh_runs
    got = torch.load(tmp / "pp_from_one.pt")
    expected = results["one_process"]
    _same_run(
        results["pp_from_one"]["losses"], got, expected["losses"][2:], torch.load(tmp / "one_process.pt")
    )


def _same_run(
    losses: list[float], got: dict[str, torch.Tensor], expected_losses: list[float], expected: dict[str, Any]
) -> None:
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    assert set(got) == set(expected)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= WEIGHT_TOLERANCE, worst


def test_the_planner_divides_states_by_the_shard_group_not_the_replicas(tmp_path: Path) -> None:
    """HSDP keeps a whole copy of the states per replica: on 4 ranks as 2 replicas x 2 shards the planner
    predicts twice the optimizer states of FSDP over 4 (the hole: the scoring divided by every rank, an
    under-prediction of HSDP's states)."""
    from memtrain.planner import plan_here

    def states(mesh: dict[str, Any]) -> int:
        recipe = tiny_recipe(
            tmp_path, strategies={"sharding": "zero3", "mesh": mesh}, batch={"micro_size": "auto"}
        )
        spec = CausalLMTrainer(tiny_recipe(tmp_path)).model_spec()  # the job; the mesh is the plan's
        result = plan_here(recipe, spec, world_size=4)
        assert result.predicted is not None
        return result.predicted.optimizer_states

    flat, hsdp = states({}), states({"dp_replicate": 2})
    assert flat > 0 and hsdp > 1.9 * flat


def test_a_run_trains_on_the_mesh_the_planner_chose_for_open_degrees(tmp_path: Path) -> None:
    """`dp_shard: auto, pp: auto` on 2 ranks: written as is, dp_shard would take both ranks (`resolve`); under a
    budget that only a 2-stage pipeline fits (the mesh search predicts 473 kB for the best dp 2 plan, 428 kB for
    pp 2), the run trains on pp 2, the mesh `memtrain plan` chooses."""
    sections = {
        "strategies": {"precision": "fp32", "sharding": "zero3", "mesh": {"dp_shard": "auto", "pp": "auto"}},
        "batch": {"global_size": 8, "micro_size": 2},
        "memory": {"budget": 460_000},
    }
    (result,) = launch(tmp_path, 2, [{"run_dir": str(tmp_path / "open"), "sections": sections}], "open")
    assert {rank["mesh"]["pp"] for rank in result["ranks"]} == {2}
    assert {rank["mesh"]["dp_shard"] for rank in result["ranks"]} == {1}
