"""The command line's rough edges (issue #15): key=value overrides after a flag, `--resume` in all its
forms among them, `plan --world-size` below 1, `plan --gpu-memory` without a unit, `--version`, and
third-party log lines in what memtrain prints.

Child processes import the memtrain that this test imports (`scenarios.child_env`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memtrain import cli
from memtrain.commands import plan
from memtrain.errors import PlanError
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.training.metrics import read_metrics

from fault_kit.scenarios import child_env, in_process, write_recipe
from helpers import REPO, tiny_recipe_dict

GIB = 2**30
TINY_SFT = "recipes/tests/tiny-sft.yaml"


def _memtrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtrain", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_overrides_after_flags_and_every_form_of_resume(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "recipe.yaml", tiny_recipe_dict(tmp_path, checkpoint={"at_end": True}))
    runs = [  # (arguments after the recipe, the step the run ends at)
        (["--no-progress", "train.steps=2", "train.log_every=1"], 2),
        (["--resume", "train.steps=3"], 3),  # the flag takes the override; the CLI gives it back
        (["--resume", "auto", "--no-progress", "train.steps=4"], 4),
        (["--resume", str(tmp_path / "run/checkpoints/step_00000003"), "--no-progress", "train.steps=5"], 5),
        (["train.steps=6", "--no-progress", "--resume"], 6),
    ]
    for args, step in runs:
        rc, out, err = in_process(cli.main, ["train", str(recipe), *args])
        assert rc == 0, f"{args}: {err}"
        assert read_metrics(tmp_path / "run/metrics.jsonl")[-1]["step"] == step, args


def test_plan_takes_overrides_after_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", TINY_SFT, "batch.global_size=16", "--json", "batch.micro_size=4"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert (summary["micro_batch_size"], summary["accumulation_steps"]) == (4, 4)


@pytest.mark.parametrize(
    "argv",
    [["train", TINY_SFT, "--no-progress", "--bogus"], ["export", "run", "--out", "out", "train.steps=1"]],
    ids=["unknown flag", "override to a command without overrides"],
)
def test_what_is_not_an_override_is_still_refused(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    assert f"unrecognized arguments: {argv[-1]}" in capsys.readouterr().err


@pytest.mark.parametrize("ranks", ["0", "-2"])
def test_plan_world_size_below_one_is_refused(ranks: str) -> None:
    rc, _, err = in_process(cli.main, ["plan", TINY_SFT, "--world-size", ranks])
    assert rc == 2
    assert "--world-size: must be at least 1" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--nodes", "2", "--world-size", "8"],
            "--world-size 8 disagrees with --nodes 2 x 8 GPUs per node = 16",
        ),
        (["--nodes", "0"], "--nodes: must be at least 1"),
        (["--gpus-per-node", "0", "--nodes", "2"], "--gpus-per-node: must be at least 1"),
    ],
)
def test_plan_cluster_flags_are_checked(flags: list[str], message: str) -> None:
    rc, _, err = in_process(cli.main, ["plan", TINY_SFT, "--gpu", "h100-80gb", *flags])
    assert rc == 2
    assert message in err


def test_plan_nodes_multiply_the_gpus_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    """--nodes 2 --gpus-per-node 2: a mesh search over 4 ranks on two nodes of 2 (tensor parallel within)."""
    argv = ["plan", TINY_SFT, "--gpu", "h100-80gb", "--nodes", "2", "--gpus-per-node", "2", "--json"]
    overrides = [
        "strategies.mesh.tp=auto",
        "strategies.sharding=zero3",
        "batch.global_size=16",
        "batch.micro_size=4",
    ]
    assert cli.main([*argv, *overrides]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["world_size"] == 4 and found["cluster"] == {
        **found["cluster"],
        "gpus_per_node": 2,
        "nodes": 2,
    }
    assert all(m["mesh"]["tp"] <= 2 for m in found["meshes"])
    crossing = {tuple(m["crosses_nodes"]) for m in found["meshes"]}
    assert ("dp_shard",) in crossing and not any("tp" in c for c in crossing)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("24", 24 * GIB),
        ("1.5", 3 * GIB // 2),
        ("24GiB", 24 * GIB),
        ("24GB", 24 * 10**9),
        ("80G", 80 * 10**9),
        ("24000MiB", 24000 * 2**20),
    ],
)
def test_gpu_memory_sizes(size: str, expected: int) -> None:
    assert plan._bytes(size, "--gpu-memory") == expected


@pytest.mark.parametrize("size", ["24 gigs", "lots", "0", "0GiB", "-8GiB"])
@pytest.mark.parametrize("flag", ["--gpu-memory", "--host-memory"])
def test_memory_size_nonsense_names_the_flag(size: str, flag: str) -> None:
    with pytest.raises(PlanError, match=f"^{flag}: "):
        plan._bytes(size, flag)


def test_host_memory_sets_the_what_if_host_and_needs_a_what_if_gpu() -> None:
    rc, out, err = in_process(
        cli.main, ["plan", TINY_SFT, "--gpu", "h100-80gb", "--host-memory", "100GiB", "--json"]
    )
    assert rc == 0, err
    rc, _, err = in_process(cli.main, ["plan", TINY_SFT, "--host-memory", "100GiB"])
    assert rc == 2 and "--host-memory: describes the host of a what-if GPU" in err
    target = what_if_target(1, load_gpu("h100-80gb"), None, 0.1, host_memory_bytes=100 * GIB)
    assert target.host_bytes == int(100 * GIB * 0.9)
    assert what_if_target(1, load_gpu("h100-80gb"), None, 0.1).host_bytes == int(256 * GIB * 0.9)


def test_gpu_memory_without_a_unit_is_gib_and_says_so() -> None:
    rc, out, err = in_process(cli.main, ["plan", TINY_SFT, "--gpu-memory", "24", "--json"])
    assert rc == 0, err
    assert json.loads(out)["budget"]["total"] == 24 * GIB
    assert "--gpu-memory 24: no unit given, read as 24 GiB" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--version"])
    assert stopped.value.code == 0
    declared = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None
    assert capsys.readouterr().out.strip() == f"memtrain {declared.group(1)}"


def test_validate_and_plan_print_only_memtrain() -> None:
    """A LoRA recipe: peft imports bitsandbytes, which logs about optional CPU kernels."""
    validated = _memtrain("validate", TINY_SFT, "adapters.kind=lora")
    assert validated.returncode == 0 and validated.stderr == ""
    assert validated.stdout.splitlines() == [f"{TINY_SFT}: ok (llama, 60 steps, global batch 8)"]
    planned = _memtrain("plan", TINY_SFT, "adapters.kind=lora", "--json")
    assert planned.returncode == 0, planned.stderr
    json.loads(planned.stdout)  # nothing else on stdout
    assert all(line.startswith("[memtrain] ") for line in planned.stderr.splitlines()), planned.stderr


def test_export_prints_only_memtrain_on_stdout(tmp_path: Path) -> None:
    """Exporting imports DeepSpeed (through transformers), which logs its accelerator to stdout."""
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        tiny_recipe_dict(tmp_path, train={"steps": 1}, checkpoint={"at_end": True}),
    )
    assert in_process(cli.main, ["train", str(recipe)])[0] == 0
    exported = _memtrain("export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.splitlines() == [
        f"[memtrain] exported step 1 of {tmp_path / 'run'} to {tmp_path / 'hf'} (Hugging Face format)"
    ]
