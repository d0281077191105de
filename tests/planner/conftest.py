"""`one_thread`: planner tests that compare a prediction with a measured run use one torch thread, so
the measured run's kernels (and their workspace) are those the prediction traced. Every planner test
shares the traces of a job another planner test already traced (`shared_traces`, tests/conftest.py):
they plan the same tiny models again and again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from memtrain.planner import model_probe


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _planner_traces_shared(shared_traces: None) -> None:
    """`shared_traces` for every planner test."""


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every `trace_step` the probes run."""
    calls: list[int] = []
    real = model_probe.trace_step

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[6])
        return real(*args, **kwargs)

    monkeypatch.setattr(model_probe, "trace_step", counting)
    return calls
