"""No code from a checkpoint: a pickle planted in any checkpoint file memtrain could read never runs.

The payload (`fault_kit.planted_pickles.Payload`, whose helpers plant it) creates a marker file when it is unpickled. It is planted in every file a
resume or an export reads: memtrain's own tensor files (model.pt, optimizer.pt, rng_rank0.pt), a DCP
checkpoint's `.metadata` and one of its byte items, and each file of a DeepSpeed checkpoint. Each
`--resume` / `memtrain export` must exit 2 with one line naming the file, without a traceback, and the
marker must stay absent. `validate` and `profile` never read a checkpoint: with every file planted they
run as usual. A checkpoint's meta.json names its format (the manifest): files of another format are
refused unread, and a checkpoint written before the manifest still resumes and exports.

The holes (before this change): torch's DCP reader unpickled `.metadata` with `pickle.load`, and its
planners loaded byte items with `torch.load(weights_only=False)`; DeepSpeed loaded every file of its own
with full pickle, on resume (its checkpoint engine) and on export (`zero_to_fp32`); export handed a
`deepspeed/` folder to DeepSpeed even in a run that never used it, when the checkpoint's own files were
gone; and a checkpoint holding files of two formats was read by whichever was detected first.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from memtrain.cli import main
from memtrain.run import CheckpointFiles

from fault_kit.planted_pickles import plant_dcp_item, plant_deepspeed_dir, plant_pickle, plant_torch_file
from helpers import REPO, subprocess_env, tiny_recipe_dict

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEP = "step_00000002"
ONE_RANK_ZERO3 = "ignore:strategies.sharding. zero3 on one rank"


def _write_recipe(root: Path, **sections: dict[str, Any]) -> Path:
    raw = tiny_recipe_dict(
        root,
        train={"steps": 2},
        checkpoint={"at_end": True, "fallback": False},
        batch={"global_size": 8, "micro_size": 4},
        **sections,
    )
    path = root / "recipe.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trained(root: Path, *overrides: str) -> Path:
    recipe = _write_recipe(root)
    assert main(["train", str(recipe), *overrides]) == 0
    return recipe


@pytest.fixture(scope="module")
def replicated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _trained(tmp_path_factory.mktemp("replicated"))


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.warns(UserWarning):
        recipe = _trained(tmp_path_factory.mktemp("dcp"), "strategies.sharding=zero3")
    if dist.is_initialized():
        dist.destroy_process_group()
    yield recipe


def _copy(recipe: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run of `recipe` in `tmp_path`: (its recipe, its checkpoint of step 2)."""
    shutil.copytree(recipe.parent, tmp_path / "copy")
    raw = json.loads(recipe.read_text())
    raw["run"]["output_dir"] = str(tmp_path / "copy/run")
    path = tmp_path / "copy/recipe.json"
    path.write_text(json.dumps(raw))
    return path, tmp_path / "copy/run/checkpoints" / STEP


def _refused(code: int, err: str, names: str, marker: Path) -> None:
    """The planted pickle did not run; exit 2, one error line naming `names`, no traceback."""
    assert not marker.exists(), "the planted pickle ran"
    errors = [line for line in err.splitlines() if line.startswith("memtrain: error:")]
    assert code == 2 and len(errors) == 1 and names in errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def _resume(recipe: Path, *overrides: str) -> int:
    return main(["train", str(recipe), "train.steps=3", *overrides, "--resume"])


def _export(recipe: Path, tmp_path: Path) -> int:
    return main(["export", str(recipe.parent / "run"), "--out", str(tmp_path / "hf")])


def _export_beside_a_fifo(recipe: Path, tmp_path: Path, fifo: Path) -> int | None:
    """`_export`'s exit code, or None when it still waits on `fifo` after 60 s (then unblocked, so the test
    process can end)."""
    done: list[int] = []
    thread = threading.Thread(target=lambda: done.append(_export(recipe, tmp_path)), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        return None
    return done[0]


# ------------------------------------------------------------------------------------- replicated


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "rng_rank0.pt"])
def test_replicated_files_load_weights_only_on_resume(
    replicated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """memtrain's own tensor files already loaded with weights_only=True; this keeps them so, and the
    refusal is now one line (torch's multi-line advice to allow-list the global was echoed whole)."""
    recipe, step = _copy(replicated_run, tmp_path)
    plant_torch_file(step / name, tmp_path / "MARKER")
    capsys.readouterr()
    code = _resume(recipe)
    err = capsys.readouterr().err
    _refused(code, err, str(step / name), tmp_path / "MARKER")
    assert "add_safe_globals" not in err
    assert not (tmp_path / "MARKER").exists()


def test_replicated_model_file_on_export(
    replicated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe, step = _copy(replicated_run, tmp_path)
    plant_torch_file(step / "model.pt", tmp_path / "MARKER")
    capsys.readouterr()
    _refused(_export(recipe, tmp_path), capsys.readouterr().err, str(step / "model.pt"), tmp_path / "MARKER")
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------- DCP


@pytest.mark.filterwarnings(ONE_RANK_ZERO3)
def test_dcp_metadata_is_never_unpickled_on_resume(
    dcp_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    one_rank_group: None,
) -> None:
    """Hole: torch's FileSystemReader.read_metadata ran pickle.load on dcp/.metadata (the marker appeared).
    A refused metadata file must be refused before DCP's loader, which logs a failed read with its
    traceback (pytest captures the log; a user saw it on stderr)."""
    recipe, step = _copy(dcp_run, tmp_path)
    plant_pickle(step / "dcp/.metadata", tmp_path / "MARKER")
    capsys.readouterr()
    _refused(
        _resume(recipe, "strategies.sharding=zero3"),
        capsys.readouterr().err,
        str(step / "dcp/.metadata"),
        tmp_path / "MARKER",
    )
    assert not [record.getMessage() for record in caplog.records if record.exc_info]
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.filterwarnings(ONE_RANK_ZERO3)
def test_dcp_byte_item_loads_weights_only_on_resume(
    dcp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], one_rank_group: None
) -> None:
    """Hole: DCP's DefaultLoadPlanner.load_bytes ran torch.load(weights_only=False) on the optimizer's
    byte items (its learning rate)."""
    recipe, step = _copy(dcp_run, tmp_path)
    plant_dcp_item(step / "dcp", "optimizer.param_groups.0.lr", tmp_path / "MARKER")
    capsys.readouterr()
    _refused(
        _resume(recipe, "strategies.sharding=zero3"),
        capsys.readouterr().err,
        "optimizer.param_groups.0.lr",
        tmp_path / "MARKER",
    )
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize("planted", ["metadata", "model byte item"])
def test_dcp_files_are_never_unpickled_on_export(
    dcp_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    planted: str,
) -> None:
    """Hole: export read dcp/.metadata with pickle.load and model byte items with weights_only=False
    (`_EmptyStateDictLoadPlanner` rebuilds every `model` entry the metadata lists)."""
    recipe, step = _copy(dcp_run, tmp_path)
    if planted == "metadata":
        plant_pickle(step / "dcp/.metadata", tmp_path / "MARKER")
    else:
        plant_dcp_item(step / "dcp", "model.planted", tmp_path / "MARKER")
    capsys.readouterr()
    _refused(_export(recipe, tmp_path), capsys.readouterr().err, str(step / "dcp"), tmp_path / "MARKER")
    assert not [record.getMessage() for record in caplog.records if record.exc_info]


def test_a_fifo_among_the_dcp_files_is_one_line_not_a_hang(
    dcp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hole (issue 43): DCP opens its data files plainly, so a FIFO in place of one made export (and a
    resume, under the run's lock) wait for a writer forever."""
    recipe, step = _copy(dcp_run, tmp_path)
    data = sorted((step / "dcp").glob("*.distcp"))[0]
    data.unlink()
    os.mkfifo(data)
    assert _export_beside_a_fifo(recipe, tmp_path, data) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memtrain: error:")]
    assert len(errors) == 1 and data.name in errors[0] and "not a regular file" in errors[0], errors


# ------------------------------------------------------------------------------------- the manifest


@pytest.mark.parametrize("kind", ["replicated", "dcp"])
def test_a_planted_deepspeed_folder_is_never_opened(
    replicated_run: Path, dcp_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """Hole: with the checkpoint's own files gone, export detected the planted `deepspeed/` folder and
    handed it to DeepSpeed's full-pickle loader (the marker appeared with deepspeed installed). Now the
    manifest says which format to read: its missing files refuse the export, and a `deepspeed/` folder
    next to whole files is refused unread, on export and on resume."""
    recipe, step = _copy(replicated_run if kind == "replicated" else dcp_run, tmp_path)
    assert json.loads(CheckpointFiles(step).meta.read_text())["format"] == kind
    own = ["model.pt", "optimizer.pt"] if kind == "replicated" else ["dcp"]
    plant_deepspeed_dir(step, tmp_path / "MARKER")
    capsys.readouterr()
    _refused(_export(recipe, tmp_path), capsys.readouterr().err, str(step / "deepspeed"), tmp_path / "MARKER")
    _refused(_resume(recipe), capsys.readouterr().err, str(step / "deepspeed"), tmp_path / "MARKER")
    for name in own:
        shutil.rmtree(step / name) if (step / name).is_dir() else (step / name).unlink()
    _refused(_export(recipe, tmp_path), capsys.readouterr().err, str(step / own[0]), tmp_path / "MARKER")
    assert not (tmp_path / "MARKER").exists()


def test_a_checkpoint_without_a_manifest_still_resumes_and_exports(
    replicated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpoints written before meta.json named their format are detected from their files."""
    recipe, step = _copy(replicated_run, tmp_path)
    meta_file = CheckpointFiles(step).meta
    meta = json.loads(meta_file.read_text())
    del meta["format"]
    meta_file.write_text(json.dumps(meta))
    assert _export(recipe, tmp_path) == 0
    assert _resume(recipe) == 0
    newest = json.loads(CheckpointFiles(step.with_name("step_00000003")).meta.read_text())
    assert newest["format"] == "replicated"


def test_a_manifest_naming_an_unknown_format_is_refused(
    replicated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe, step = _copy(replicated_run, tmp_path)
    meta_file = CheckpointFiles(step).meta
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "format": "pickle"}))
    capsys.readouterr()
    _refused(_export(recipe, tmp_path), capsys.readouterr().err, "'pickle'", tmp_path / "MARKER")


# ------------------------------------------------------------------------------------- validate, profile


def test_validate_and_profile_never_read_a_checkpoint(
    replicated_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With every file of the run's checkpoint planted, `validate` and `profile` run as usual."""
    recipe, step = _copy(replicated_run, tmp_path)
    for name in ("model.pt", "optimizer.pt", "rng_rank0.pt"):
        plant_torch_file(step / name, tmp_path / "MARKER")
    plant_deepspeed_dir(step, tmp_path / "MARKER")
    assert main(["validate", str(recipe)]) == 0
    assert main(["profile", str(recipe), "--steps", "1", "--out", str(tmp_path / "profile")]) == 0
    assert (tmp_path / "profile/memory.json").is_file()
    assert not (tmp_path / "MARKER").exists()


# ------------------------------------------------------------------------------------- DeepSpeed

DEEPSPEED = ["strategies.sharding=zero2", "strategies.sharding_backend=deepspeed"]
DEEPSPEED_FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
]


def _two_ranks(recipe: Path, *args: str, logs: Path | None = None) -> subprocess.CompletedProcess[str]:
    redirect = ["--log-dir", str(logs), "--redirects", "3"] if logs is not None else []
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *redirect]
    env = subprocess_env()
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache/torch_extensions"))
    return subprocess.run(
        [*command, "-m", "memtrain", "train", str(recipe), *DEEPSPEED, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    recipe = _write_recipe(tmp_path_factory.mktemp("deepspeed"))
    done = _two_ranks(recipe)
    assert done.returncode == 0, done.stderr[-3000:]
    return recipe


@pytest.mark.distributed
@pytest.mark.parametrize("name", DEEPSPEED_FILES)
def test_deepspeed_files_load_weights_only_on_export(
    deepspeed_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Hole: export merged DeepSpeed's partitions with zero_to_fp32, which loads with weights_only=False."""
    recipe, step = _copy(deepspeed_run, tmp_path)
    assert json.loads(CheckpointFiles(step).meta.read_text())["format"] == "deepspeed"
    plant_torch_file(step / "deepspeed/state" / name, tmp_path / "MARKER")
    capsys.readouterr()
    _refused(_export(recipe, tmp_path), capsys.readouterr().err, name, tmp_path / "MARKER")
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.distributed
def test_a_fifo_among_the_deepspeed_files_is_one_line_not_a_hang(
    deepspeed_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hole (issue 43): DeepSpeed opens its files plainly, so a FIFO in place of one (here rank 1's
    optimizer states) made export, and a resume under the run's lock, wait for a writer forever."""
    recipe, step = _copy(deepspeed_run, tmp_path)
    fifo = next((step / "deepspeed").rglob(DEEPSPEED_FILES[2]))
    fifo.unlink()
    os.mkfifo(fifo)
    assert _export_beside_a_fifo(recipe, tmp_path, fifo) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memtrain: error:")]
    assert len(errors) == 1 and fifo.name in errors[0] and "not a regular file" in errors[0], errors
    done_resume = _two_ranks(recipe, "train.steps=3", "--resume")
    assert done_resume.returncode != 0 and "not a regular file" in done_resume.stderr, done_resume.stderr[
        -3000:
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("name", [DEEPSPEED_FILES[0], DEEPSPEED_FILES[2]])
def test_deepspeed_files_load_weights_only_on_resume(deepspeed_run: Path, tmp_path: Path, name: str) -> None:
    """Hole: DeepSpeed's TorchCheckpointEngine.load ran torch.load(weights_only=False) on resume. The model
    states are read by both ranks; rank 1's optimizer states by rank 1 alone (the ranks agree on the
    failed candidate, so both stop)."""
    recipe, step = _copy(deepspeed_run, tmp_path)
    plant_torch_file(step / "deepspeed/state" / name, tmp_path / "MARKER")
    logs = tmp_path / "logs"
    done = _two_ranks(recipe, "train.steps=3", "--resume", logs=logs)
    assert done.returncode != 0
    errors = {}
    for rank in (0, 1):
        (err,) = logs.rglob(f"attempt_0/{rank}/stderr.log")
        text = err.read_text()
        lines = [line for line in text.splitlines() if line.startswith("memtrain") and "error:" in line]
        assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
        errors[rank] = lines[0]
    assert name in errors[1], errors
    assert not (tmp_path / "MARKER").exists()
