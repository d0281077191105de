"""The validation set (`data.eval`: a file, a glob, a datasets split, or the held-out `data.eval_fraction`),
the eval loss and perplexity in metrics.jsonl, TensorBoard and the progress line, and early stopping
(`train.early_stopping`) that stops at the right evaluation and resumes exactly."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import data_checks
from memtrain.causal_lm.recipe import CausalLMRecipe, DataConfig
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError
from memtrain.recipe import EarlyStoppingConfig
from memtrain.training.evaluation import EarlyStopping
from memtrain.training.metrics import read_metrics

from helpers import Killed, tiny_recipe, tiny_recipe_dict


def _texts(samples: list[data_lib.Sample]) -> list[str]:
    return sorted(bytes(s.input_ids.tolist()).decode() for s in samples)


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh datasets cache (nothing shared with the user's ~/.cache)."""
    import datasets.config

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


# ------------------------------------------------------------------------------------ the eval set


def test_eval_set_from_a_file_and_a_glob_else_the_fraction(tmp_path: Path) -> None:
    """The hole: there was no data.eval; a validation file could not be named, only a held-out fraction
    of the training data. Now its rows are the eval rows and no training row is held out; unset, the
    last data.eval_fraction of the shuffled samples is held out, as before."""
    train = _jsonl(tmp_path / "train.jsonl", [f"train document {i}" for i in range(20)])
    _jsonl(tmp_path / "val-a.jsonl", [f"val a{i}" for i in range(3)])
    _jsonl(tmp_path / "val-b.jsonl", [f"val b{i}" for i in range(2)])
    base = {"source": "jsonl", "path": str(train), "seq_len": 32, "packing": False, "eval_fraction": 0.25}
    held_out = data_lib.build_splits(DataConfig(**base), 256, 0)
    assert (len(held_out.train), len(held_out.eval)) == (15, 5)
    assert _texts(held_out.train + held_out.eval) == sorted(f"train document {i}\n" for i in range(20))
    one = data_lib.build_splits(DataConfig(**base, eval=str(tmp_path / "val-a.jsonl")), 256, 0)
    assert _texts(one.eval) == [f"val a{i}\n" for i in range(3)]
    assert len(one.train) == 20  # all of it: data.eval replaces the held-out fraction
    both = data_lib.build_splits(DataConfig(**base, eval={"path": str(tmp_path / "val-*.jsonl")}), 256, 0)
    assert _texts(both.eval) == [f"val a{i}\n" for i in range(3)] + [f"val b{i}\n" for i in range(2)]


def test_eval_set_from_a_dataset_split(tmp_path: Path, datasets_cache: Path) -> None:
    """The hole: a dataset's validation split could not be the eval set (data.split named the training
    split only)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [f"train document {i}" for i in range(30)])
    _jsonl(folder / "validation.jsonl", [f"held {i}" for i in range(4)])
    cfg = DataConfig(
        source="dataset", path=str(folder), seq_len=64, packing=False, eval={"split": "validation"}
    )
    splits = data_lib.build_splits(cfg, 256, 0)
    assert _texts(splits.eval) == [f"held {i}\n" for i in range(4)]
    assert len(splits.train) == 30


def test_eval_problems_name_the_eval_keys(tmp_path: Path) -> None:
    """The hole: nothing checked an eval set before training; a wrong one must be a validate-time problem
    naming data.eval.*, not data.path (the eval set is read through a copy of the data section)."""
    train = _jsonl(tmp_path / "train.jsonl", ["a document"])
    base = {"source": "jsonl", "path": str(train)}
    missing = data_checks.data_problems(DataConfig(**base, eval=str(tmp_path / "none.jsonl")))
    assert len(missing) == 1 and missing[0].startswith("data.eval.path: file not found")
    split = data_checks.data_problems(DataConfig(**base, eval={"split": "validation"}))
    assert split == ["data.eval.split: only data.source dataset has splits; give data.eval.path instead"]
    no_match = data_checks.data_problems(DataConfig(**base, eval=str(tmp_path / "x-*.jsonl")))
    assert no_match == [f"data.eval.path: no file matches {tmp_path / 'x-*.jsonl'}"]
    early = tiny_recipe_dict(tmp_path, train={"early_stopping": {"patience": 2}})
    with pytest.raises(RecipeError, match=r"train\.early_stopping: .*train\.eval_every"):
        CausalLMRecipe.from_dict(early)
    unseen = tiny_recipe_dict(
        tmp_path, train={"eval_every": 2, "early_stopping": {"patience": 2}}, data={"eval_fraction": 0.0}
    )
    with pytest.raises(RecipeError, match=r"train\.early_stopping: no eval set; set data\.eval"):
        CausalLMRecipe.from_dict(unseen)


# ------------------------------------------------------------------------------------ loss and perplexity

PROGRESS = re.compile(r"^\[memtrain\] step (\d+)/4 .* eval_loss (\d+\.\d{4}) ppl (\S+)$", re.MULTILINE)


def test_eval_loss_and_perplexity_in_metrics_tensorboard_and_progress(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The hole: metrics rows had an eval loss but no perplexity, and the progress line neither (a rate
    limited line could skip the evaluation's step altogether)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output = {"progress": "off", "loggers": ["jsonl", "tensorboard"], "log_every_s": 3600}
    recipe = tiny_recipe(tmp_path, train={"eval_every": 2, "eval_batches": 1}, output=output)
    CausalLMTrainer(recipe).fit()
    rows = [r for r in read_metrics(tmp_path / "run/metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        assert row["eval_perplexity"] == pytest.approx(math.exp(row["eval_loss"]), rel=1e-12)
    events = EventAccumulator(str(tmp_path / "run/tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("eval_loss", "eval_perplexity"):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert logged == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows], tag
    printed = PROGRESS.findall(capfd.readouterr().err)  # step 2 although within the hour's rate limit
    assert [int(step) for step, _, _ in printed] == [2, 4]
    for (_, loss, ppl), row in zip(printed, rows, strict=True):
        assert (loss, ppl) == (f"{row['eval_loss']:.4f}", f"{row['eval_perplexity']:.4g}")


# ------------------------------------------------------------------------------------ early stopping


def test_early_stopping_counts_evaluations_without_improvement() -> None:
    stopping = EarlyStopping(EarlyStoppingConfig(patience=2, min_delta=0.05))
    stopped_at = None
    for step, loss in zip(range(1, 7), [3.0, 2.0, 2.1, 1.96, 1.9, 2.5], strict=True):
        stopping.observe(step, loss)
        if stopping.stopped:
            stopped_at = step
            break
    # 2.0 is the best; 2.1 and 1.96 (not 0.05 below it) do not improve on it: the second of them stops
    assert stopped_at == 4 and (stopping.best, stopping.best_step, stopping.since_best) == (2.0, 2, 2)
    assert not EarlyStopping(None).stopped


EVAL_LOSSES = {2: 3.0, 4: 2.0, 6: 2.1, 8: 1.99, 10: 2.5, 12: 2.6}
"""Eval loss after each evaluated step: with patience 2 and min_delta 0.05 the run stops after step 8."""


class ConstructedEval(CausalLMTrainer):
    """Evaluates to `EVAL_LOSSES` (the step's), so when the run stops is known in advance."""

    def train_step(self, step: int) -> dict[str, Any]:
        self.at = step + 1
        return super().train_step(step)

    def evaluate(self) -> float:
        return EVAL_LOSSES[self.at]


class KilledAtStep8(ConstructedEval):
    def train_step(self, step: int) -> dict[str, Any]:
        if step == 7:
            raise Killed
        return super().train_step(step)


def _stopping(tmp_path: Path, patience: int = 2) -> CausalLMRecipe:
    return tiny_recipe(
        tmp_path,
        train={"steps": 12, "eval_every": 2, "early_stopping": {"patience": patience, "min_delta": 0.05}},
        checkpoint={"every": 3, "keep": 5, "at_end": True},
    )


def test_early_stopping_stops_at_the_right_evaluation_and_resumes_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The hole: nothing stopped a run on its eval loss. It stops after step 8 with a checkpoint and a line
    saying why; a run killed after its step-6 checkpoint (one evaluation without improvement counted)
    stops at the same step with the same losses, which needs the count saved in the checkpoint; resuming
    the stopped run trains nothing, and a larger patience (a free key) trains on."""
    straight = ConstructedEval(_stopping(tmp_path / "a")).fit()
    assert straight.stopped_early == 8 and straight.steps_done == 8
    assert sorted(straight.eval_losses) == [2, 4, 6, 8]
    assert "early stopping: stopped after step 8 with a checkpoint" in capsys.readouterr().out

    with pytest.raises(Killed):
        KilledAtStep8(_stopping(tmp_path / "b")).fit()
    resumed = ConstructedEval(_stopping(tmp_path / "b")).fit(resume=True)
    assert resumed.stopped_early == 8 and resumed.losses == straight.losses[6:8]

    again = ConstructedEval(_stopping(tmp_path / "a")).fit(resume=True)  # from the step-8 checkpoint
    assert again.steps_done == 8 and again.losses == []
    assert "this run stopped after step 8, nothing to train" in capsys.readouterr().out
    patient = ConstructedEval(_stopping(tmp_path / "a", patience=5)).fit(resume=True)
    assert patient.steps_done == 12 and patient.stopped_early is None
