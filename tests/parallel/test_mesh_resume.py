"""Checkpoints across meshes: a run resumed on another mesh and another world size ends as if uninterrupted.

One torchrun launch of 4 ranks runs, in sequence, from the same pretrained weights: HSDP 2 x 2 for steps
1-2, FSDP 4 resuming it for steps 3-4, FSDP x TP 2 x 2 for steps 1-2, and TP 4 (no FSDP) resuming a
one-process checkpoint of steps 1-2 for steps 3-4. In pytest, one process resumes each chain's last
checkpoint (FSDP 4's, FSDP x TP's, TP 4's) to step 6. Each chain must read the same samples per step as one uninterrupted process (every id of a
step's global batch once, by one data-parallel rank; tensor ranks of a data-parallel rank the same ones),
with losses within 1e-6 and weights as close as another order of the gradient sums allows
(helpers.REDUCTION_ORDER). `memtrain export` of each mesh's checkpoint gives the whole weights that run trained.

The random-number files of a checkpoint are per rank; a rank whose own file is missing (a resume on more
ranks) loads rank 0's, and a resume on fewer ranks leaves the others' unread. Neither can change what is
trained: the data order is a function of the step alone, and the tiny models have no dropout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.commands import export

from helpers import TINY_LLAMA, assert_trained_alike, tiny_recipe_dict

sys.path.insert(0, str(Path(__file__).parent))
from mesh_jobs import launch, whole_weights  # noqa: E402
from mesh_trainers import RecordingTrainer  # noqa: E402

STEPS = 6
LOSS_TOLERANCE = 1e-6
HSDP = {"dp_replicate": 2, "dp_shard": 2}
FSDP_X_TP = {"dp_shard": 2, "tp": 2}
# Untied (tensor parallel splits the head apart from the embedding), 4 KV heads (tensor parallel over 4).
CONFIG = {**TINY_LLAMA, "tie_word_embeddings": False, "num_key_value_heads": 4}
# The 4-rank jobs, in launch order: name -> (steps it ends at, mesh, sharding, micro-batch, the job it resumes)
JOBS: dict[str, tuple[int, dict[str, int], str, int, str | None]] = {
    "hsdp": (2, HSDP, "zero3", 1, None),
    "fsdp4": (4, {"dp_shard": 4}, "zero3", 1, "hsdp"),
    "fsdp_x_tp": (2, FSDP_X_TP, "zero3", 2, None),
    "tp4": (4, {"tp": 4}, "none", 2, "one_first"),  # one_first: one process's steps 1-2, before the launch
}
ONE_RANK = {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
CHAINS = {  # each ends on one process at step 6
    "hsdp_2x2-fsdp_4-one_process": ("hsdp", "fsdp4"),
    "fsdp_x_tp_2x2-one_process": ("fsdp_x_tp",),
    "one_process-tp_4-one_process": ("one_first", "tp4"),
}


def _checkpoints(tmp: Path, name: str | None) -> str | None:
    return name and str(tmp / name / "run" / "checkpoints")


def _sections(
    tmp: Path, steps: int, mesh: dict[str, int] | None, sharding: str, micro: int
) -> dict[str, Any]:
    return {
        "model": {"config": None, "pretrained": str(tmp / "pretrained")},
        "strategies": {"sharding": sharding, **({"mesh": mesh} if mesh else {})},
        "batch": {"global_size": 8, "micro_size": micro},
        "train": {"steps": steps, "schedule": "constant"},
        "checkpoint": {"at_end": True},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """The 4-rank jobs, from pretrained weights, in one launch, after one process's steps 1-2."""
    tmp = tmp_path_factory.mktemp("resume")
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG)).save_pretrained(tmp / "pretrained")
    losses, _, ids = _one_process(tmp, "one_first", steps=2)
    first = {
        "losses": losses,
        "ranks": [{"coordinates": ONE_RANK, "sample_ids": {str(s): ids[s] for s in ids}}],
    }
    jobs = [
        {
            "run_dir": str(tmp / name),
            "weights_out": str(tmp / f"{name}.pt"),
            "sections": _sections(tmp, steps, mesh, sharding, micro),
            "trainer": "RecordingTrainer",
            "resume": _checkpoints(tmp, resumes),
        }
        for name, (steps, mesh, sharding, micro, resumes) in JOBS.items()
    ]
    return tmp, {"one_first": first, **dict(zip(JOBS, launch(tmp, 4, jobs, "resume"), strict=True))}


def _one_process(
    tmp: Path, name: str, resume: str | None = None, steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor], dict[int, list[int]]]:
    """Train to `steps` on one process (sharding none), from the checkpoints of job `resume` if given."""
    raw = tiny_recipe_dict(tmp / name, **_sections(tmp, steps, None, "none", 2))
    trainer = RecordingTrainer(CausalLMRecipe.from_dict(raw))
    losses = trainer.fit(resume=_checkpoints(tmp, resume)).losses
    return losses, whole_weights(trainer), trainer.seen_ids


@pytest.fixture(scope="module")
def uninterrupted(
    runs: tuple[Path, dict[str, Any]],
) -> tuple[list[float], dict[str, torch.Tensor], dict[int, list[int]]]:
    return _one_process(runs[0], "one")


def _read_ids(rank_results: list[dict[str, Any]], steps: range) -> dict[int, list[int]]:
    """Per step, the ids the data-parallel ranks read together, tensor ranks of one agreeing."""
    read: dict[int, list[int]] = {}
    for step in steps:
        by_dp: dict[tuple[int, int], list[int]] = {}
        for rank in rank_results:
            coordinates, ids = rank["coordinates"], rank["sample_ids"][str(step)]
            key = (coordinates["dp_replicate"], coordinates["dp_shard"])
            assert by_dp.setdefault(key, ids) == ids, (step, coordinates)  # a tensor rank read other rows
        read[step] = sorted(i for ids in by_dp.values() for i in ids)
    return read


@pytest.mark.parametrize("chain", CHAINS)
def test_resume_on_another_mesh_is_the_uninterrupted_run(
    chain: str,
    runs: tuple[Path, dict[str, dict[str, Any]]],
    uninterrupted: tuple[list[float], dict[str, torch.Tensor], dict[int, list[int]]],
) -> None:
    """Each segment of the chain reads the uninterrupted run's sample ids of its steps, each once by one
    data-parallel rank; the chain's losses (within 1e-6) and final weights are that run's. Every run
    starts from pretrained weights (HSDP's and FSDP x TP's read straight into their shards). The holes: pretrained weights
    were sliced as if the mesh were 1-D and sharded on dim 0 (HSDP and FSDP x TP failed to start), and
    a tensor-parallel run without FSDP (`tp4`, sharding none) pickled rank 0's DTensor shards into
    model.pt (a resume read rank 0's shard on every rank; one process could not read it), and read a
    one-process checkpoint's whole tensors into its shards as plain tensors (refused)."""
    tmp, results = runs
    losses, weights, ids = uninterrupted
    chained: list[float] = []
    for name in CHAINS[chain]:
        steps = range(len(chained), len(chained) + len(results[name]["losses"]))
        assert _read_ids(results[name]["ranks"], steps) == {s: sorted(ids[s]) for s in steps}, name
        chained += results[name]["losses"]
    last, resumed_weights, resumed_ids = _one_process(tmp, f"{chain}_one", CHAINS[chain][-1])
    rest = range(len(chained), STEPS)
    assert {s: resumed_ids[s] for s in rest} == {s: ids[s] for s in rest}
    assert chained + last == pytest.approx(losses, abs=LOSS_TOLERANCE)
    assert_trained_alike(resumed_weights, weights, load_file(tmp / "pretrained" / "model.safetensors"))


@pytest.mark.parametrize("name", JOBS)
def test_export_of_each_mesh_checkpoint(name: str, runs: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """`memtrain export` of each mesh's checkpoint: a Hugging Face directory holding the whole weights the
    run trained (tensor-parallel shards and HSDP's replicas joined once)."""
    tmp, _ = runs
    export.run(tmp / name / "run", tmp_path / "hf")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    trained = torch.load(tmp / f"{name}.pt")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)  # fp32 written, fp32 read: bit-exact
