"""examples/own_model: a Trainer subclass (plain PyTorch, tied weights, a frozen module, padded batches, its
own loss; no transformers, no `model:` section) planned by `memtrain plan --json` and measured by
`memtrain profile --json`, through the CLI as a user runs them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from memtrain.cli import main

from helpers import REPO

RECIPE = str(REPO / "examples/own_model/recipe.yaml")
TRAINER = str(REPO / "examples/own_model/trainer.py") + ":TinyTrainer"
PINNED = [
    "strategies.sharding=none",
    "strategies.optimizer_states=fp32",
    "strategies.checkpointing=none",
    "batch.micro_size=8",
]
PLANS = {  # the six plans of the acceptance list, each as overrides on top of PINNED
    "fp32": [],
    "bf16-mixed": ["strategies.precision=bf16-mixed"],
    "full": ["strategies.checkpointing=full"],
    "fraction": ["strategies.checkpointing=fraction", "strategies.checkpointing_fraction=0.5"],
    "8bit": ["strategies.optimizer_states=8bit"],
    "accumulation": ["batch.micro_size=2"],
}
TOLERANCE = 0.02


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def _tiny_model():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "examples/own_model"))
    from trainer import TinyLM  # the example's own module

    return TinyLM(max_len=64)


@pytest.mark.parametrize("name", PLANS)
def test_plan_predicts_the_profiled_peak(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [*PINNED, *PLANS[name], f"run.output_dir={tmp_path}"]
    planned = _json(capsys, "plan", RECIPE, *overrides, "--trainer", TRAINER, "--json")
    profiled = _json(capsys, "profile", RECIPE, *overrides, "--trainer", TRAINER, "--json", "--steps", "3")
    predicted, measured = planned["predicted"]["peak"], profiled["steady_peak_bytes"]
    assert abs(predicted - measured) / measured <= TOLERANCE, (name, predicted, measured)

    model = _tiny_model()
    frozen_element = 2 if name == "bf16-mixed" else 4  # a frozen module in the compute dtype (bf16-mixed)
    weights = sum(p.numel() * (4 if p.requires_grad else frozen_element) for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]  # the tied tensor once
    trainable_bytes = sum(p.numel() * 4 for p in trainable)
    assert weights > trainable_bytes, "the example has a frozen module"
    states = planned["model_states"]
    assert states["weights"] == weights, "predicted weights are the subclass's parameter bytes, exactly"
    assert states["gradients"] == trainable_bytes, "frozen parameters carry no gradient bytes"
    assert profiled["at_peak"]["weights"] == weights
    assert profiled["at_peak"]["gradients"] <= trainable_bytes
    if name in ("fp32", "accumulation"):  # torch AdamW: two fp32 moments and a step per trainable tensor
        assert states["optimizer_states"] == 2 * trainable_bytes + 4 * len(trainable), "none for frozen ones"
        assert profiled["at_peak"]["optimizer_states"] in (0, states["optimizer_states"])


def test_subclass_recipe_needs_no_model_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = Path(RECIPE).read_text()
    assert "\nmodel:" not in text
    assert main(["validate", RECIPE, "--trainer", TRAINER]) == 0
    assert "TinyTrainer:" in capsys.readouterr().out
    assert (
        main(
            [
                "train",
                RECIPE,
                "train.steps=3",
                f"run.output_dir={tmp_path}",
                "--trainer",
                TRAINER,
                "--no-progress",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["predicted"]["peak"] > 0, "the open recipe was planned from the subclass's own model"


def test_built_in_trainer_still_needs_a_model_section(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", RECIPE]) == 2
    assert "model: give model.pretrained" in capsys.readouterr().err


def test_the_trainers_own_recipe_part_is_its_schema(capsys: pytest.CaptureFixture[str]) -> None:
    """The example declares its own `data:` section (`TinyRecipe`): a key it does not read, and the
    built-in trainer's model keys, are refused by name; `memtrain schema --trainer` shows its section,
    and a memory tip names its sequence-length key."""
    bad = ["data.packing=true", "model.pretrained=somewhere", "data.seq_len=0"]
    assert main(["validate", RECIPE, *bad, "--trainer", TRAINER]) == 2
    err = capsys.readouterr().err
    for line in (
        "data.packing: unknown key",
        "model.pretrained: unknown key",
        "data.seq_len: Input should be",
    ):
        assert line in err, err
    schema = _json(capsys, "schema", "--trainer", TRAINER)
    assert set(schema["properties"]["data"]["$ref"].split("/")[-1:]) == {"TinyData"}
    assert set(schema["$defs"]["TinyData"]["properties"]) == {"seq_len"}
    assert (
        "pretrained"
        not in schema["$defs"][schema["properties"]["model"]["$ref"].split("/")[-1]]["properties"]
    )
    from memtrain.commands.trainers import trainer_class
    from memtrain.planner.explain import suggestions

    recipe = trainer_class(TRAINER).recipe_class.load(RECIPE)
    assert any(tip.startswith("data.seq_len (now 64)") for tip in suggestions(recipe))


def test_bad_trainer_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("nowhere.py:X", str(REPO / "examples/own_model/trainer.py") + ":Missing", "no_colon"):
        assert main(["validate", RECIPE, "--trainer", bad]) == 2
        assert "--trainer" in capsys.readouterr().err


@pytest.mark.distributed
def test_subclass_under_torchrun_matches_one_process(tmp_path: Path) -> None:
    """`torchrun -m memtrain train ... --trainer FILE:Class` on 2 gloo ranks (DDP) trains the same run as
    one process: each rank's rows come from its own step_batch, and the loss is the global token mean."""
    import subprocess

    import torch

    from memtrain.training.metrics import read_metrics

    from helpers import subprocess_env

    common = [
        RECIPE,
        "train.steps=4",
        "strategies.optimizer_states=fp32",
        "strategies.checkpointing=none",
        "batch.micro_size=auto",
        "--trainer",
        TRAINER,
        "--no-progress",
    ]
    runs = {
        "single": [sys.executable, "-m", "memtrain", "train", "strategies.sharding=none"],
        "ddp": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "memtrain",
            "train",
            "strategies.sharding=ddp",
        ],
    }
    for name, launch in runs.items():
        out = tmp_path / name
        args = [*launch[:-1], *common[:1], launch[-1], f"run.output_dir={out}", *common[1:]]
        done = subprocess.run(
            args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    single = [row["loss"] for row in read_metrics(tmp_path / "single/metrics.jsonl")]
    ddp = [row["loss"] for row in read_metrics(tmp_path / "ddp/metrics.jsonl")]
    assert len(single) == len(ddp) == 4
    assert ddp == pytest.approx(single, rel=1e-5), "the same global batch and loss on 1 and 2 ranks"
    states = [
        torch.load(tmp_path / n / "checkpoints/step_00000004/model.pt", weights_only=True) for n in runs
    ]
    # The ranks sum the gradients in another order: compared as a whole, not per element (tests/helpers.py,
    # `REDUCTION_ORDER`: AdamW can step an element whose gradient nearly cancels differently by up to lr).
    from memtrain.commands.trainers import trainer_class

    from helpers import assert_trained_alike, initial_weights

    fresh = [*common[1:5], "strategies.sharding=none", f"run.output_dir={tmp_path / 'initial'}"]
    own = trainer_class(TRAINER)
    initial = initial_weights(own.recipe_class.load(RECIPE, fresh), own)
    assert_trained_alike(states[1], states[0], initial)
