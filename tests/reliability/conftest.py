"""Every reliability test runs torch on one thread: runs here are compared bit for bit with runs in child
processes, which the fault kit starts with OMP_NUM_THREADS=1."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
