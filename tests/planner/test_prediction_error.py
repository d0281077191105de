"""The reserved margin is the measured prediction error: read from the file the replay of published runs
writes, checked when read, never below the floor; the replay's own arithmetic of under- and over-prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.errors import MemtrainError
from memtrain.planner.prediction_error import (
    ERROR_FILE,
    MARGIN_FLOOR,
    MeasuredError,
    measured_error,
    reserved_margin,
    write_measured_error,
)


def test_the_shipped_file_is_a_measurement_and_sets_the_default_margin() -> None:
    found = measured_error()
    assert found.runs >= 1 and "bench_published.py" in found.source
    assert reserved_margin(None) == max(MARGIN_FLOOR, found.under_prediction)
    assert reserved_margin(0.07) == 0.07, "a recipe's planner.reserved_margin wins"


def test_margin_is_the_under_prediction_never_below_the_floor(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_measured_error(MeasuredError(0.041, 0.12, 5, "test"), path)
    assert measured_error(path).margin == 0.041
    write_measured_error(MeasuredError(0.0, 0.12, 5, "test"), path)
    assert measured_error(path).margin == MARGIN_FLOOR, "over-predictions do not shrink the margin below it"


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        json.dumps({"under_prediction": 0.01}),
        json.dumps({"under_prediction": 2.0, "over_prediction": 0.0, "runs": 1, "source": "x"}),
    ],
)
def test_a_malformed_file_is_an_error_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(text)
    with pytest.raises(MemtrainError, match="error.json"):
        measured_error(path)


def test_the_replay_measures_under_and_over_prediction_on_counted_rows_and_torchs_counters() -> None:
    import bench_published

    def record(
        published: float, predicted_gib: float, counted: bool, counter: str = "reserved"
    ) -> dict[str, object]:
        return {
            "row": {"published": published, "unit": "GiB", "counter": counter},
            "predicted_on_counter": int(predicted_gib * 2**30),
            "counted": counted,
        }

    found = bench_published.measured(
        [
            record(52.0, 50.0, True),
            record(45.0, 50.0, True),
            record(99.0, 50.0, False),
            record(80.0, 50.0, True, counter="device"),
        ]
    )
    assert found.under_prediction == pytest.approx(0.04) and found.over_prediction == pytest.approx(0.1)
    assert found.runs == 2, "a row with a lever memtrain lacks, or on the device's counter, does not size it"
    assert ERROR_FILE.name == "prediction_error.json"
