"""A new logger, learning-rate schedule or data source is one file plus one registry line: the toys
(toy_logger.py, toy_schedule.py, toy_source.py) are registered, named by a recipe, listed in the schema
and used by the trainer, with no other file edited; a name nobody registered is a one-line error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.sources import DATA_SOURCES, schema_with_sources
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.commands.trainers import validate
from memtrain.errors import RecipeError
from memtrain.loggers import LOGGERS, LoggerEntry
from memtrain.schedules import SCHEDULES, Schedule
from memtrain.training.metrics import read_metrics

from helpers import TINY_LLAMA, tiny_recipe
from toy_logger import ToyLogger
from toy_schedule import halving
from toy_source import SENTENCE, RepeatedText

BYTE_LLAMA = {**TINY_LLAMA, "vocab_size": 256}  # the byte tokenizer's ids


@pytest.fixture
def toy_logger() -> Iterator[None]:
    LOGGERS.register(LoggerEntry("toy", ToyLogger))  # the one registry line
    yield
    LOGGERS.unregister("toy")


@pytest.fixture
def toy_schedule() -> Iterator[None]:
    SCHEDULES.register(Schedule("halving", halving))  # the one registry line
    yield
    SCHEDULES.unregister("halving")


@pytest.fixture
def toy_source() -> Iterator[None]:
    DATA_SOURCES.register(RepeatedText())  # the one registry line
    yield
    DATA_SOURCES.unregister(RepeatedText.name)


def _source_recipe(tmp_path: Path) -> CausalLMRecipe:
    return tiny_recipe(
        tmp_path,
        model={"config": BYTE_LLAMA},
        data={"source": "repeated-text", "packing": False, "seq_len": 16},
    )


def _only_problem(caught: pytest.ExceptionInfo[RecipeError]) -> str:
    (problem,) = caught.value.problems
    assert "\n" not in problem
    return problem


def _metrics(tmp_path: Path) -> list[dict[str, Any]]:
    return read_metrics(tmp_path / "run" / "metrics.jsonl")


@pytest.mark.usefixtures("toy_logger")
def test_toy_logger_receives_every_row(tmp_path: Path) -> None:
    schema = CausalLMRecipe.editor_schema()["$defs"]["OutputConfig"]["properties"]["loggers"]
    assert schema["items"]["enum"] == ["jsonl", "tensorboard", "wandb", "mlflow", "toy"]
    recipe = tiny_recipe(tmp_path, run={"name": "toy-logger"}, output={"loggers": ["jsonl", "toy"]})
    result = CausalLMTrainer(recipe).fit()
    received = ToyLogger.received.pop("toy-logger")
    assert [row["step"] for row in received] == [1, 2, 3, 4]
    assert [row["loss"] for row in received] == result.losses == [row["loss"] for row in _metrics(tmp_path)]
    assert "toy-logger" in ToyLogger.closed


@pytest.mark.usefixtures("toy_schedule")
def test_toy_schedule_sets_each_steps_lr(tmp_path: Path) -> None:
    assert (
        CausalLMRecipe.editor_schema()["$defs"]["TrainConfig"]["properties"]["schedule"]["enum"][-1]
        == "halving"
    )
    CausalLMTrainer(tiny_recipe(tmp_path, train={"schedule": "halving", "lr": 0.04})).fit()
    lrs = [row["lr"] for row in _metrics(tmp_path)]
    assert lrs == [0.04, 0.02, 0.01, 0.005]


@pytest.mark.usefixtures("toy_source")
def test_toy_source_is_what_the_trainer_trains_on(tmp_path: Path) -> None:
    assert schema_with_sources(CausalLMRecipe.editor_schema())["$defs"]["DataConfig"]["properties"]["source"][
        "enum"
    ] == [
        "synthetic",
        "text",
        "jsonl",
        "dataset",
        "repeated-text",
    ]
    trainer = CausalLMTrainer(_source_recipe(tmp_path))
    assert {bytes(s.input_ids.tolist()) for s in trainer.train_samples} == {f"{SENTENCE}\n".encode()}
    trainer.fit()
    rows = _metrics(tmp_path)
    targets = len(SENTENCE) + 1  # a row's targets: the sentence after its first byte, and the blank line
    assert [row["tokens"] for row in rows] == [8 * targets] * 4
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_unregistered_names_are_one_line_recipe_errors(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as caught:
        tiny_recipe(tmp_path, output={"loggers": ["jsonl", "toy"]})
    assert _only_problem(caught).startswith("output.loggers: 'toy' is not one of jsonl, tensorboard")
    with pytest.raises(RecipeError) as caught:
        tiny_recipe(tmp_path, train={"schedule": "halving"})
    assert _only_problem(caught) == "train.schedule: 'halving' is not one of cosine, linear, constant, wsd"
    recipe = _source_recipe(tmp_path)  # the data source is checked with the data: by validate and train
    expected = "data.source: 'repeated-text' is not one of synthetic, text, jsonl, dataset"
    for check in (lambda: validate(recipe, "recipe", CausalLMTrainer), lambda: CausalLMTrainer(recipe)):
        with pytest.raises(RecipeError) as caught:
            check()
        assert _only_problem(caught) == expected
