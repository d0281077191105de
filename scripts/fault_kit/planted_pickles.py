"""Planted pickles: a pickle that runs code when unpickled, in every checkpoint file memtrain could read.

Why: a run directory is data. Anyone who can write into a shared one must not be able to run code as
whoever resumes or exports it. Each trial copies a finished run, plants a payload (a global drawn from
the seed: `open`, `os.system` or `exec`, each creating a marker file) in one file, and runs the command
that reads that file: `train --resume` or `export` must exit 2 with one line naming the file and no
traceback; `validate` and `profile` (which read no checkpoint) must run as usual. In every case the
marker must stay absent. tests/reliability/test_no_pickle.py uses the same planting helpers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memtrain import cli
from memtrain.run import CheckpointFiles

from fault_kit.scenarios import TINY_LLAMA, Outcome, in_process, timed

STEP = "step_00000002"
PAYLOADS = ("open", "os.system", "exec")


class Payload:
    """Unpickled, it creates `marker` through the global `how` (one of `PAYLOADS`)."""

    def __init__(self, marker: Path, how: str = "open") -> None:
        self.marker, self.how = str(marker), how

    def __reduce__(self) -> tuple[Any, ...]:
        if self.how == "os.system":
            return (os.system, (f"touch '{self.marker}'",))
        if self.how == "exec":
            return (exec, (f"open({self.marker!r}, 'w').close()",))
        return (open, (self.marker, "w"))


def plant_torch_file(path: Path, marker: Path, how: str = "open") -> None:
    """`path` as a torch.save file whose pickle runs the payload."""
    torch.save({"state": Payload(marker, how)}, path)


def plant_pickle(path: Path, marker: Path, how: str = "open") -> None:
    """`path` as a plain pickle of the payload (what torch's DCP metadata file is)."""
    path.write_bytes(pickle.dumps(Payload(marker, how)))


def plant_dcp_item(dcp_dir: Path, fqn: str, marker: Path, how: str = "open") -> None:
    """Point DCP byte item `fqn` (added to the metadata when the checkpoint has none of that name) at a
    torch.save of the payload appended to the data file."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta_file = dcp_dir / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())  # our own checkpoint, written by this kit
    buffer = io.BytesIO()
    torch.save(Payload(marker, how), buffer)
    template = next(iter(metadata.storage_data.values()))
    data_file = dcp_dir / template.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as handle:
        handle.write(buffer.getvalue())
    index = next((i for i in metadata.storage_data if i.fqn == fqn), None)
    if index is None:
        index = MetadataIndex(fqn)
        metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
        metadata.planner_data[fqn] = tuple(fqn.split(".", 1))
    metadata.storage_data[index] = dataclasses.replace(template, offset=offset, length=len(buffer.getvalue()))
    meta_file.write_bytes(pickle.dumps(metadata))


def plant_deepspeed_dir(step: Path, marker: Path, how: str = "open") -> None:
    """A `deepspeed/` folder with what DeepSpeed's export reader (zero_to_fp32) opens first."""
    state = step / "deepspeed/state"
    state.mkdir(parents=True)
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"):
        plant_torch_file(state / name, marker, how)


def refusal_problem(rc: int | str, err: str, names: str, marker: Path, expect: int = 2) -> str | None:
    """What is wrong with a command that read a planted file (None: nothing)."""
    if marker.exists():
        return "the planted pickle ran"
    if "Traceback" in err or "Traceback" in str(rc):
        return f"a traceback: {str(rc)[:300]} {err[-300:]}"
    if rc != expect:
        return f"exit {rc}, expected {expect}: {err[-300:]}"
    errors = [line for line in err.splitlines() if line.startswith("memtrain: error:")]
    if expect == 2 and (len(errors) != 1 or names not in errors[0]):
        return f"not one error line naming {names}: {err[-300:]}"
    return None


# ---------------------------------------------------------------------------------------------- runs


def recipe_file(root: Path, **strategies: str) -> Path:
    """A tiny two-step run's recipe under `root`, checkpointed at its end, no fallback."""
    raw = {
        "run": {"name": "planted", "output_dir": str(root / "run"), "seed": 3},
        "model": {"config": dict(TINY_LLAMA)},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 64, "min_len": 4}},
        "batch": {"global_size": 8, "micro_size": 4},
        "train": {"steps": 2, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0},
        "checkpoint": {"every": 0, "keep": 3, "at_end": True, "fallback": False},
        "output": {"progress": "off"},
        "strategies": {"precision": "fp32", "sharding": "none", **strategies},
    }
    path = root / "recipe.json"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(raw))
    return path


def copy_run(recipe: Path, where: Path) -> tuple[Path, Path]:
    """A copy of the run of `recipe` at `where`: (its recipe, its checkpoint of step 2)."""
    shutil.copytree(recipe.parent, where)
    raw = json.loads(recipe.read_text())
    raw["run"]["output_dir"] = str(where / "run")
    path = where / "recipe.json"
    path.write_text(json.dumps(raw))
    return path, where / "run/checkpoints" / STEP


def _drop_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


Plant = Callable[[Path, Path, str], None]  # (checkpoint dir, marker, payload)


def _trials() -> list[tuple[str, str, Plant, str, str]]:
    """(run kind, command, plant, the file the error names, label) of every trial."""
    resume, export = "resume", "export"

    def file(name: str) -> Plant:
        return lambda step, marker, how: plant_torch_file(step / name, marker, how)

    metadata: Plant = lambda step, marker, how: plant_pickle(step / "dcp/.metadata", marker, how)  # noqa: E731
    lr = "optimizer.param_groups.0.lr"
    return [
        *[
            ("replicated", resume, file(n), n, f"{n} on resume")
            for n in ("model.pt", "optimizer.pt", "rng_rank0.pt")
        ],
        ("replicated", export, file("model.pt"), "model.pt", "model.pt on export"),
        ("dcp", resume, metadata, ".metadata", "dcp/.metadata on resume"),
        ("dcp", export, metadata, ".metadata", "dcp/.metadata on export"),
        ("dcp", resume, lambda s, m, h: plant_dcp_item(s / "dcp", lr, m, h), lr, "a DCP byte item on resume"),
        (
            "dcp",
            export,
            lambda s, m, h: plant_dcp_item(s / "dcp", "model.planted", m, h),
            "model.planted",
            "a DCP model byte item on export",
        ),
        ("replicated", export, plant_deepspeed_dir, "deepspeed", "a deepspeed/ folder on export"),
        ("dcp", resume, plant_deepspeed_dir, "deepspeed", "a deepspeed/ folder on resume"),
    ]


def planted_pickles(work: Path, seed: int) -> Outcome:
    """Every trial of `_trials`, plus validate and profile over a run whose every file is planted."""
    outcome = Outcome("planted pickles", "a code-running pickle in each checkpoint file memtrain could read")
    rng = random.Random(f"{seed}-planted")
    with timed(outcome):
        runs = {
            "replicated": recipe_file(work / "replicated"),
            "dcp": recipe_file(work / "dcp", sharding="zero3"),
        }
        for kind, recipe in runs.items():
            rc, _, err = in_process(cli.main, ["train", str(recipe)])
            _drop_group()
            if rc != 0:
                outcome.record(f"the {kind} run failed: {err[-300:]}", f"{kind} run")
                return outcome
        for number, (kind, command, plant, names, label) in enumerate(_trials()):
            how = rng.choice(PAYLOADS)
            recipe, step = copy_run(runs[kind], work / f"trial{number}")
            marker = work / f"trial{number}.marker"
            plant(step, marker, how)
            argv = (
                ["train", str(recipe), "train.steps=3", "--resume"]
                if command == "resume"
                else ["export", str(recipe.parent / "run"), "--out", str(recipe.parent / "hf")]
            )
            rc, _, err = in_process(cli.main, argv)
            _drop_group()
            outcome.record(refusal_problem(rc, err, names, marker), f"{label} ({how})")
            outcome.count(f"{command} refused")
        _validate_and_profile(outcome, runs["replicated"], work, rng.choice(PAYLOADS))
        if importlib.util.find_spec("deepspeed") is None:
            outcome.figures["deepspeed"] = (
                "not installed: its files are covered by tests/reliability/test_no_pickle.py"
            )
    return outcome


def _validate_and_profile(outcome: Outcome, run: Path, work: Path, how: str) -> None:
    recipe, step = copy_run(run, work / "unread")
    marker = work / "unread.marker"
    for name in ("model.pt", "optimizer.pt", CheckpointFiles(step).rng(0).name):
        plant_torch_file(step / name, marker, how)
    for argv in (
        ["validate", str(recipe)],
        ["profile", str(recipe), "--steps", "1", "--out", str(work / "unread-profile")],
    ):
        rc, _, err = in_process(cli.main, argv)
        outcome.record(
            refusal_problem(rc, err, "", marker, expect=0), f"{argv[0]} over planted files ({how})"
        )
        outcome.count("validate/profile untouched")
