"""HostAllocations: every CPU allocation of a step, a compiled step's included.

Why not the tracker: the tracker is a TorchDispatchMode, so it sees an op's outputs only. Inductor's
generated code allocates its buffers in its own wrapper (`empty_strided_cpu`), below the dispatcher, and
its kernels write into them; and dynamo runs a compiled region eagerly, from then on, when it is entered
with a non-infrastructure dispatch mode active (measured on torch 2.13: a module compiled with
`nn.Module.compile()` and called once under the tracker stays eager afterwards too). So a compiled step is
measured with no dispatch mode at all, from the allocator's side: with memory profiling on, c10's CPU
allocator reports every allocation and free to torch.profiler (`ProfiledCPUMemoryReporter`), whatever
made it.

What it counts: the bytes of the allocations made inside `with`, at their highest and at the exit. Blocks
allocated before are not known to the reporter, so their frees are not reported: the level is relative to
the start, and the caller adds what was alive then (`alive_bytes`: the model's parameters, buffers,
gradients, optimizer state and the batch). On an eager step this equals the tracker's peak to the byte
(tests/memory/test_host_allocations.py), on CPU only (the CUDA caching allocator has its own peak).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile

from ._torch_private import allocation_sizes
from .ledger import storages_of


class HostAllocations:
    """``with HostAllocations() as watch:`` then `watch.peak_bytes` / `watch.end_bytes`: the highest and
    the final level of the CPU bytes allocated inside, relative to the start."""

    def __init__(self) -> None:
        self._profile: profile | None = None
        self.sizes: list[int] = []

    def __enter__(self) -> HostAllocations:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._profile is not None
        self._profile.__exit__(exc_type, exc, tb)
        self.sizes = allocation_sizes(self._profile)
        self._profile = None

    @property
    def peak_bytes(self) -> int:
        return max(itertools.accumulate(self.sizes), default=0)

    @property
    def end_bytes(self) -> int:
        return sum(self.sizes)


def alive_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The CPU storage bytes `tensors` hold, each storage once (views and tied weights share one)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        for st in storages_of(tensor):
            if st.device.type == "cpu":
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
