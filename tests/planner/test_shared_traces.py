"""`model_probe.shared_traces`: probes of the same job share their traced sizes, probes of another job (or
of the same key with a hook swapped) do not, and a shared trace is the trace the probe would have made."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.planner import model_probe
from memtrain.planner.model_probe import ModelProbe, shared_traces
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.precision import Precision

from planner_cases import MODEL, planner_recipe


@pytest.fixture(autouse=True)
def off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, as in a program, until a test turns it on (the planner tests' own memo is set aside)."""
    monkeypatch.setattr(model_probe, "_shared", None)


def _fit(probe: ModelProbe) -> Any:
    return probe.trace(Precision(), NoCheckpointing(), (1, 2))


def _probe(tmp_path: Path, **sections: dict[str, Any]) -> ModelProbe:
    return ModelProbe(CausalLMTrainer(planner_recipe(tmp_path, **sections)).model_spec())


def test_same_job_shares_other_jobs_do_not(tmp_path: Path, traces: list[int]) -> None:
    with shared_traces() as memo:
        first = _fit(_probe(tmp_path / "a"))
        assert traces == [1, 2] and len(memo) == 2
        again = _fit(_probe(tmp_path / "b"))  # another run directory, the same job
        assert traces == [1, 2], "the same job is not traced again"
        assert again == first
        _fit(_probe(tmp_path / "c", data={"seq_len": 16}))  # another batch shape
        _fit(_probe(tmp_path / "d", model={"config": {**MODEL, "num_hidden_layers": 4}}))  # another model
        assert traces == [1, 2] * 3 and len(memo) == 6
    _fit(_probe(tmp_path / "e"))  # outside: every probe traces
    assert traces == [1, 2] * 4 and len(memo) == 6


def test_a_shared_trace_is_the_trace_a_probe_makes(tmp_path: Path) -> None:
    alone = _fit(_probe(tmp_path / "alone"))
    with shared_traces():
        _fit(_probe(tmp_path / "a"))
        shared = _fit(_probe(tmp_path / "b"))
    assert shared == alone


def test_swapped_hooks_and_subclasses_are_not_shared(tmp_path: Path, traces: list[int]) -> None:
    class OwnBatches(CausalLMTrainer):
        def planning_batch(self, rows: int) -> dict[str, torch.Tensor]:
            return super().planning_batch(rows)

    recipe = planner_recipe(tmp_path)
    spec = CausalLMTrainer(recipe).model_spec()
    assert spec.trace_key is not None
    assert OwnBatches(recipe).model_spec().trace_key is None, "a subclass's hooks may read anything"
    patched = CausalLMTrainer(recipe)
    patched.loss = lambda model, batch: CausalLMTrainer.loss(patched, model, batch)
    assert patched.model_spec().trace_key is None, "so may an instance's"
    with shared_traces() as memo:
        _fit(ModelProbe(spec))
        swapped = dataclasses.replace(spec, loss=lambda model, batch: spec.loss(model, batch))
        _fit(ModelProbe(swapped))  # the same key, another loss function: traced again
        assert traces == [1, 2, 1, 2] and len(memo) == 4
        _fit(ModelProbe(OwnBatches(recipe).model_spec()))
        assert traces == [1, 2] * 3 and len(memo) == 4
        threads = torch.get_num_threads()
        torch.set_num_threads(3 - min(threads, 2))  # 1 <-> 2: torch's threads are part of the key
        try:
            _fit(ModelProbe(spec))
        finally:
            torch.set_num_threads(threads)
        assert traces == [1, 2] * 4 and len(memo) == 6
