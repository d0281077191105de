"""Experiment loggers: each logged metrics row reaches TensorBoard, W&B (offline) and MLflow (file store)
with the values metrics.jsonl holds; a missing package is a recipe error before training; runs without a
terminal print plain progress lines."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError
from memtrain.loggers import scalars
from memtrain.training.loggers import ProgressLine, check_loggers, format_progress, make_loggers
from memtrain.training.metrics import read_metrics

from helpers import tiny_recipe

TRACKED = {"memory": {"track": True}}
ROW: dict[str, Any] = {
    "step": 3,
    "loss": 2.5,
    "lr": 1e-3,
    "tokens_per_s": 1234.4,
    "skipped": False,
    "peak_memory_bytes": 3 * 2**20,
    "tracked": {
        "peak_bytes": 900,
        "at_peak": {"weights": 100, "activations": 800},
        "peak_phase": "forward",
        "peak_module": "model.layers.0",
    },
}


def _fit(tmp_path: Path, loggers: list[str], **sections: dict[str, Any]) -> Any:
    output = {"progress": "off", "loggers": loggers, **sections.pop("output", {})}
    return CausalLMTrainer(tiny_recipe(tmp_path, output=output, **sections)).fit()


def _jsonl(tmp_path: Path) -> list[dict[str, Any]]:
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# ------------------------------------------------------------------------------------ rows


def test_scalars_flatten_memory_components_and_drop_text() -> None:
    assert scalars(ROW) == {
        "loss": 2.5,
        "lr": 1e-3,
        "tokens_per_s": 1234.4,
        "skipped": 0.0,
        "peak_memory_bytes": float(3 * 2**20),
        "memory/peak_bytes": 900.0,
        "memory/weights": 100.0,
        "memory/activations": 800.0,
    }


def test_only_rank_zero_logs(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, output={"loggers": ["jsonl", "tensorboard"]})
    assert make_loggers(recipe.output.loggers, tmp_path, recipe, is_main=False) == []
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ adapters


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path: Path) -> None:
    _fit(tmp_path, ["jsonl", "tensorboard"], **TRACKED)
    rows = _jsonl(tmp_path)
    logged = _tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert len(rows) == 4
    for tag in ("loss", "lr", "tokens_per_s", "grad_norm", "peak_memory_bytes"):
        assert logged[tag] == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows], tag
    for component in ("weights", "gradients", "optimizer_states", "activations"):
        expected = [(r["step"], pytest.approx(r["tracked"]["at_peak"][component], rel=1e-6)) for r in rows]
        assert logged[f"memory/{component}"] == expected, component
    assert "memory/peak_phase" not in logged


class CrashesAtStep3(CausalLMTrainer):
    def train_step(self, step: int) -> dict:
        if step == 3:
            raise KeyboardInterrupt("simulated kill")
        return super().train_step(step)


def test_tensorboard_reads_as_one_run_after_resume(tmp_path: Path) -> None:
    sections: dict[str, Any] = {
        "output": {"progress": "off", "loggers": ["jsonl", "tensorboard"]},
        "checkpoint": {"every": 2, "keep": 2, "at_end": False},
    }
    with pytest.raises(KeyboardInterrupt):
        CrashesAtStep3(tiny_recipe(tmp_path, **sections)).fit()  # logs steps 1-3, checkpoint at 2
    CausalLMTrainer(tiny_recipe(tmp_path, **sections)).fit(resume=True)  # logs steps 3-4 again
    rows = _jsonl(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    logged = _tensorboard_scalars(tmp_path / "run" / "tensorboard")["loss"]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]


def test_wandb_offline_run_in_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    _fit(tmp_path, ["wandb"])
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (history,) = runs[0].glob("run-*.wandb")
    assert history.stat().st_size > 0
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # only the loggers named are used


def test_mlflow_file_store_has_metrics(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    result = _fit(tmp_path, ["jsonl", "mlflow"], **TRACKED)
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("memtrain").experiment_id])
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in losses] == [(i + 1, loss) for i, loss in enumerate(result.losses)]
    weights = client.get_metric_history(run.info.run_id, "memory/weights")
    assert [m.value for m in weights] == [r["tracked"]["at_peak"]["weights"] for r in _jsonl(tmp_path)]


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("logger", "module"), [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")]
)
def test_missing_package_is_a_recipe_error_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logger: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    trainer = CausalLMTrainer(tiny_recipe(tmp_path, output={"loggers": ["jsonl", logger]}))
    with pytest.raises(RecipeError, match=rf"output\.loggers: '{logger}' needs .*memtrain\[{logger}\]"):
        trainer.fit()
    assert trainer.model is None, "the error must come before the model is built"
    assert not (tmp_path / "run").exists()


def test_unknown_logger_names_the_key() -> None:
    with pytest.raises(RecipeError, match=r'output\.loggers: unknown logger .*did you mean "wandb"'):
        check_loggers(["jsonl", "wandbb"])


# ------------------------------------------------------------------------------------ progress lines

LINE = re.compile(r"^\[memtrain\] step (\d+)/4 loss \d+\.\d{4} lr \S+ tok/s \d+ peak \S+", re.MULTILINE)


def test_plain_progress_line_without_terminal(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _fit(tmp_path, ["jsonl"], output={"log_every_s": 30})
    steps = [int(m) for m in LINE.findall(capfd.readouterr().err)]
    assert steps == [1, 4]  # the first step, then nothing for 30 s but the last step


def test_progress_line_off_when_log_every_s_is_zero(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path, ["jsonl"], output={"log_every_s": 0})
    assert not LINE.search(capfd.readouterr().err)


def test_progress_line_rate_limit(capsys: pytest.CaptureFixture[str]) -> None:
    times = iter([0.0, 4.0, 10.0, 12.0, 13.0])
    line = ProgressLine(total=5, every_s=10.0, enabled=True, clock=lambda: next(times))
    for step in range(1, 6):
        line.update({**ROW, "step": step})
    printed = capsys.readouterr().err.splitlines()
    assert printed == [format_progress({**ROW, "step": s}, 5) for s in (1, 3, 5)]
    assert printed[0] == "[memtrain] step 1/5 loss 2.5000 lr 0.001 tok/s 1234 peak 3.00 MiB"
