"""Every JSON file memtrain writes is strict JSON: NaN/inf become null and are listed under `nonfinite`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memtrain import json_out
from memtrain.loggers import JsonlLogger, LoggerContext


def _strict_loads(text: str) -> object:
    def refuse(constant: str) -> float:
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_nonfinite_numbers_become_null_and_are_listed() -> None:
    text = json_out.dumps({"loss": 1.5, "eval_loss": float("nan"), "rows": [float("inf"), 2.0]})
    loaded = _strict_loads(text)
    assert loaded == {
        "loss": 1.5,
        "eval_loss": None,
        "rows": [None, 2.0],
        "nonfinite": ["eval_loss=nan", "rows[0]=inf"],
    }


def test_metrics_jsonl_with_a_nan_eval_loss_is_strict_json(tmp_path: Path) -> None:
    log = JsonlLogger(
        LoggerContext(tmp_path / "metrics.jsonl", tmp_path / "recipe.json", tmp_path, "run", {}, None)
    )
    log.log(1, {"step": 1, "loss": 2.0, "eval_loss": math.nan})
    log.close()
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    row = _strict_loads(line)
    assert isinstance(row, dict) and row["eval_loss"] is None and row["nonfinite"] == ["eval_loss=nan"]


def test_a_plain_json_dump_of_nan_would_not_be_strict() -> None:
    """The check above can fail: the standard library's default output is refused by it."""
    with pytest.raises(ValueError, match="non-standard"):
        _strict_loads(json.dumps({"eval_loss": math.nan}))
