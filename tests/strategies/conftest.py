"""Strategy tests run PyTorch on one intra-op thread: their tensors are too small to gain from a
second one, which stalls on a busy 2-core machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
