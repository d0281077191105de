"""Pre-flight: an output directory that cannot take a checkpoint, a disk without room for one, and a
memory budget below the weights stop `memtrain train` before step 1 (and `memtrain validate`), with one
line naming the key, instead of failing after the steps (or with a traceback).

Tests run as root, for whom every directory is writable: "not writable" is injected through the one
writability probe, `preflight._writable`, which is `os.access` (it honours read-only mounts for root too).
"""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtrain import cli
from memtrain.errors import RecipeError

from fault_kit.scenarios import in_process
from helpers import tiny_recipe, tiny_recipe_dict


def write(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe_dict(tmp_path, **sections)), encoding="utf-8")
    return path


def both_fail(path: Path, *expected: str) -> None:
    """validate and train exit 2 with one message holding `expected`, before any step ran."""
    for command in ("validate", "train"):
        rc, _, err = in_process(cli.main, [command, str(path)])
        assert rc == 2, f"{command}: exit {rc}\n{err[-1500:]}"
        assert "Traceback" not in err
        for text in expected:
            assert text in err, (command, text, err[-1500:])
    assert not list(path.parent.rglob("metrics.jsonl")), "a step ran"


def not_writable(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Paths ending in `name` are not writable (as on a read-only mount or without permission)."""
    from memtrain.training import preflight

    real = preflight._writable
    monkeypatch.setattr(preflight, "_writable", lambda path: path.name != name and real(path))


def test_output_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file")
    path = write(tmp_path, run={"output_dir": str(tmp_path / "taken")})
    both_fail(path, "run.output_dir", "is a file, not a directory")


def test_output_dir_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file")
    path = write(tmp_path, run={"output_dir": str(tmp_path / "taken/run")})
    both_fail(path, "run.output_dir", "cannot create", "is a file")


def test_output_dir_not_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "locked").mkdir()
    not_writable(monkeypatch, "locked")
    path = write(tmp_path, run={"output_dir": str(tmp_path / "locked/run")})
    both_fail(path, "run.output_dir", "locked is not writable")


def test_checkpoints_not_writable_is_found_before_step_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    not_writable(monkeypatch, "checkpoints")
    path = write(tmp_path, checkpoint={"every": 2})
    both_fail(path, "run.output_dir", "checkpoints is not a writable directory")


def test_disk_without_room_for_one_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.training import preflight

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda _path: usage(10**6, 10**6 - 1000, 1000))
    path = write(tmp_path, checkpoint={"every": 2})
    rc, _, err = in_process(cli.main, ["train", str(path)])
    assert rc == 2 and "checkpoint.every: one checkpoint of this plan takes about" in err, err[-1500:]
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    no_saves = write(tmp_path, checkpoint={"every": 0, "at_end": False})
    rc, _, err = in_process(cli.main, ["train", str(no_saves)])
    assert rc == 0, err[-1500:]  # a run that saves nothing needs no room


def test_memory_budget_below_the_weights(tmp_path: Path) -> None:
    path = write(tmp_path, memory={"budget": 1})
    both_fail(path, "memory.budget: 1 bytes is less than the", "weights alone")
    zero = write(tmp_path, memory={"budget": 0})
    both_fail(zero, "memory.budget")


def test_validate_creates_no_directory(tmp_path: Path) -> None:
    path = write(tmp_path, run={"output_dir": str(tmp_path / "new/deeper/run")})
    rc, _, err = in_process(cli.main, ["validate", str(path)])
    assert rc == 0, err
    assert not (tmp_path / "new").exists()


def test_checkpoint_bytes_of_a_pinned_plan_are_weights_and_adam_states(tmp_path: Path) -> None:
    from memtrain.causal_lm.trainer import CausalLMTrainer
    from memtrain.strategies.blocks import model_shape
    from memtrain.training import preflight

    trainer = CausalLMTrainer(tiny_recipe(tmp_path))
    trainer.choose_plan()
    shape = model_shape(trainer.build_model(), [])
    expected = 4 * shape.numel + 2 * 4 * shape.numel + 4 * len(shape.params)  # fp32 weights, m and v, step
    assert preflight.checkpoint_bytes(trainer.plan, shape, trainer.plan_result) == expected


def test_every_rank_raises_when_rank_0_found_a_problem() -> None:
    from memtrain.training import preflight

    preflight.agree([], any_rank=False)
    with pytest.raises(RecipeError, match="rank 0 found a problem"):
        preflight.agree([], any_rank=True)  # what another rank sees
