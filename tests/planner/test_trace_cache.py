"""`planner/trace_cache.py`: a traced size kept on disk is read back as the very trace a probe makes (every
segment, the allocation log, the gradients), a plan made from the cache is the plan made without it, and
another job, a changed file or a planted file is a miss, never a wrong trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.memory.headroom import load_gpu
from memtrain.planner import model_probe, plan_what_if, trace_cache
from memtrain.planner.explain import to_json
from memtrain.planner.model_probe import ModelProbe
from memtrain.strategies.checkpointing import FullCheckpointing, NoCheckpointing
from memtrain.strategies.precision import Precision

from planner_cases import MODEL, planner_recipe


@pytest.fixture(autouse=True)
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No in-process memo: every hit below is the disk's."""
    monkeypatch.setattr(model_probe, "_shared", None)


def _probe(tmp_path: Path, **sections: dict[str, Any]) -> ModelProbe:
    return ModelProbe(CausalLMTrainer(planner_recipe(tmp_path, **sections)).model_spec())


def _steps(probe: ModelProbe) -> list[Any]:
    probe.trace(Precision(), FullCheckpointing(), (1, 2))
    return list(probe._steps.values())


def test_a_cached_trace_is_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, traces: list[int]
) -> None:
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", "off")
    made = _steps(_probe(tmp_path / "off"))
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    first = _steps(_probe(tmp_path / "a"))
    assert traces == [1, 2, 1, 2] and len(list((tmp_path / "cache/traces").iterdir())) == 2
    again = _steps(_probe(tmp_path / "b"))  # another process's probe of the same job: read, not traced
    assert traces == [1, 2, 1, 2]
    assert again == first == made  # segments, allocation logs and gradients, equal field by field
    assert all(step.allocations and step.segments for step in again)
    _steps(_probe(tmp_path / "c", model={"config": {**MODEL, "num_hidden_layers": 4}}))  # another model
    _steps(_probe(tmp_path / "d", data={"seq_len": 16}))  # another batch
    assert traces == [1, 2] * 4


@pytest.mark.parametrize("config", [MODEL, {**MODEL, "num_hidden_layers": 2}], ids=["clone", "whole"])
def test_a_plan_from_the_cache_is_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]
) -> None:
    """The whole `--json` document of a CUDA what-if (its reserved bytes replayed), without the cache,
    writing it and reading it: the optimisation on and off predict the same, to the byte. Five blocks are
    traced as a three-block clone, two are traced whole (model_probe.py): both paths to a trace."""
    gpu = load_gpu("h100-80gb")
    sections = {
        "model": {"config": config},
        "strategies": {"checkpointing": "full", "optimizer_states": "fp32"},
    }

    def planned(name: str) -> dict[str, Any]:
        trainer = CausalLMTrainer(planner_recipe(tmp_path / name, **sections))
        result = plan_what_if(trainer.recipe, trainer.model_spec(), 1, gpu=gpu, progress=lambda _l: None)
        return to_json(result)

    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", "off")
    without = planned("off")
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    assert planned("cold") == without
    assert len(list((tmp_path / "cache/traces").iterdir())) >= 2
    assert len(list((tmp_path / "cache/numbers").iterdir())) >= 1, "a replay of the reserved bytes kept"
    assert planned("warm") == without
    assert without["candidates"] and all(c["predicted_reserved"] for c in without["candidates"][:1])


def test_other_keys_and_planted_files_are_misses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, traces: list[int]
) -> None:
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    _steps(_probe(tmp_path / "a"))
    files = sorted((tmp_path / "cache/traces").iterdir())
    docs = [json.loads(f.read_text()) for f in files]
    # a file whose stored key is not the key asked for (a digest collision, a file copied over): a miss
    files[0].write_text(json.dumps({**docs[0], "key": docs[0]["key"] + "x"}))
    # a value of the wrong type: a miss, not a trace with a string where bytes were
    docs[1]["trace"]["allocations"][1][1][0][1] = "4096"
    files[1].write_text(json.dumps(docs[1]))
    _steps(_probe(tmp_path / "b"))
    assert traces == [1, 2, 1, 2], "both traced again"
    assert [json.loads(f.read_text()) for f in files] != [docs[0], docs[1]], "and rewritten"
    # memtrain's own code is in the key: a changed source makes every key new
    before = trace_cache._sources()
    monkeypatch.setattr(trace_cache, "_sources", lambda: before + "changed")
    _steps(_probe(tmp_path / "c"))
    assert traces == [1, 2] * 3


def test_off_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    probe = _probe(tmp_path / "a")
    probe.trace(Precision(), NoCheckpointing(), (1, 2))
    assert trace_cache.cache_dir() is None and not (tmp_path / "xdg").exists()
