"""`one_thread`: planner tests that compare a prediction with a measured run use one torch thread, so
the measured run's kernels (and their workspace) are those the prediction traced. Every planner test
shares the traces of a job another planner test already traced (`shared_traces`, tests/conftest.py):
they plan the same tiny models again and again."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _planner_traces_shared(shared_traces: None) -> None:
    """`shared_traces` for every planner test."""
