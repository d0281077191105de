"""Subclasses with models unlike a transformer (tests/subclass/unusual/trainers.py).

A model without repeated blocks (a GRU, a BatchNorm, a branch that never runs, a dict output, an auxiliary
loss): the planner offers only `checkpointing: none` (every other mode would recompute nothing), names why
the others are out, refuses a pinned one with the key to change, and predicts the profiled peak. A model
that cannot train on one row (BatchNorm blocks): that micro-batch size is excluded with the cause, the
others are planned. A lazy module: refused in one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.cli import main

HERE = Path(__file__).parent / "unusual"
RECIPE = str(HERE / "recipe.yaml")
TRAINER = str(HERE / "trainers.py") + ":GruTrainer"
NORM_MLP = str(HERE / "trainers.py") + ":NormMlpTrainer"
LAZY = str(HERE / "trainers.py") + ":LazyTrainer"
BARE_LOSS = str(HERE / "trainers.py") + ":BareLossTrainer"
NO_BATCH = str(HERE / "trainers.py") + ":NoBatchTrainer"
ENCODER = str(HERE / "trainers.py") + ":EncoderTrainer"
TUPLE_BATCH = str(HERE / "trainers.py") + ":TupleBatchTrainer"
NO_OPTIMIZER = str(HERE / "trainers.py") + ":NoOptimizerTrainer"
FUNCTION_MODEL = str(HERE / "trainers.py") + ":FunctionModelTrainer"


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("micro", [4, 1])
def test_a_model_without_blocks_is_planned_to_its_profiled_peak(
    micro: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [f"batch.micro_size={micro}", f"run.output_dir={tmp_path}", "--trainer", TRAINER]
    planned = _json(capsys, "plan", RECIPE, *overrides, "--json")
    assert planned["summary"]["checkpointing"] == "none"
    excluded = {row["option"]: row["reason"] for row in planned["excluded"]}
    for mode in ("full", "selective", "fraction", "offload"):
        assert "no repeated blocks" in excluded[f"strategies.checkpointing={mode}"]
    profiled = _json(capsys, "profile", RECIPE, *overrides, "--json", "--steps", "3")
    predicted, measured = planned["predicted"]["peak"], profiled["steady_peak_bytes"]
    assert abs(predicted - measured) / measured <= 0.02, (predicted, measured)
    states = planned["model_states"]
    assert states["gradients"] < states["weights"], "the branch that never runs gets no gradient"


def test_a_pinned_mode_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        RECIPE,
        "strategies.checkpointing=full",
        f"run.output_dir={tmp_path}",
        "--trainer",
        TRAINER,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no repeated blocks" in err and "strategies.checkpointing: none" in err, err


def test_it_trains_and_plans_a_mesh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", RECIPE, f"run.output_dir={tmp_path}", "--trainer", TRAINER, "--no-progress"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    capsys.readouterr()
    planned = _json(
        capsys, "plan", RECIPE, "--gpu", "h100-80gb", "--world-size", "4", "--trainer", TRAINER, "--json"
    )
    assert planned["summary"]["checkpointing"] == "none" and planned["candidates"][0]["fits"]


def test_a_pipeline_is_refused_for_a_trainer_that_cannot_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        RECIPE,
        "strategies.mesh.pp=2",
        "--gpu",
        "h100-80gb",
        "--world-size",
        "4",
        "--trainer",
        TRAINER,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "strategies.mesh.pp: the trainer cannot split its model into pipeline stages" in err, err


def test_a_micro_batch_size_the_model_cannot_run_is_excluded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [f"run.output_dir={tmp_path}", "strategies.checkpointing=none", "--trainer", NORM_MLP]
    planned = _json(capsys, "plan", RECIPE, *overrides, "--json")
    excluded = {row["option"]: row["reason"] for row in planned["excluded"]}
    assert "Expected more than 1 value per channel" in excluded["batch.micro_size=1"]
    assert {c["micro_batch_size"] for c in planned["candidates"]} == {2, 4}
    assert main(["plan", RECIPE, *overrides, "batch.micro_size=1"]) == 2, "a pinned size is the user's call"
    assert "Expected more than 1 value per channel" in capsys.readouterr().err
    profiled = _json(capsys, "profile", RECIPE, *overrides, "batch.micro_size=2", "--json", "--steps", "3")
    planned = _json(capsys, "plan", RECIPE, *overrides, "batch.micro_size=2", "--json")
    predicted, measured = planned["predicted"]["peak"], profiled["steady_peak_bytes"]
    assert abs(predicted - measured) / measured <= 0.02, (predicted, measured)


def test_a_lazy_module_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("plan", "train", "validate"):
        assert main([command, RECIPE, f"run.output_dir={tmp_path}", "--trainer", LAZY]) == 2
        err = capsys.readouterr().err
        assert "uninitialised (lazy) parameters or buffers (inp.weight, inp.bias)" in err, (command, err)
        assert "Traceback" not in err


def test_hooks_that_break_their_contract_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loss that returns the bare sum, a missing step_batch, a token split over labels without rows of
    tokens, a batch that is not a dict of tensors, an optimizer builder without a return, a model builder
    that returns no module: one line each naming what to change, in plan and in train."""
    cases = [
        (BARE_LOSS, [], "loss must return (loss_sum, num_tokens)", "it returned a tensor of shape ()"),
        (NO_BATCH, [], "NoBatchTrainer: implement step_batch(step)", ""),
        (
            NORM_MLP,
            ["batch.micro_tokens=40"],
            "batch.micro_tokens: splitting by tokens",
            "Trainer.row_tokens",
        ),
        (
            TUPLE_BATCH,
            [],
            "TupleBatchTrainer.step_batch(step) must return a dict of tensors",
            "returned tuple",
        ),
        (NO_OPTIMIZER, [], "NoOptimizerTrainer.build_optimizer(params) must return", "returned NoneType"),
        (FUNCTION_MODEL, [], "build_model() must return a torch.nn.Module", "returned type"),
    ]
    for trainer, overrides, first, second in cases:
        # planning splits no batch and builds no optimizer: the run's setup or first step finds those
        for command in ("plan", "train") if not overrides and trainer != NO_OPTIMIZER else ("train",):
            argv = [command, RECIPE, *overrides, f"run.output_dir={tmp_path / command}", "--trainer", trainer]
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert first in err and second in err and "Traceback" not in err, (trainer, command, err)


def test_torchs_transformer_encoder_is_traced_with_fake_tensors(capsys: pytest.CaptureFixture[str]) -> None:
    """nn.TransformerEncoder deep-copies its layer while it is built: under fake tensors the copies once held
    a copy of the fake mode, the trace failed, and a CUDA target was planned from a real CPU trace (CPU
    attention kernels)."""
    argv = ["plan", RECIPE, "strategies.precision=bf16-mixed", "--gpu", "h100-80gb", "--trainer", ENCODER]
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert "CUDA" in json.loads(out)["attention"]
    assert "trace failed" not in err, err
