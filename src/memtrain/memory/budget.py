"""A simulated device budget: CPU runs hit a real `torch.OutOfMemoryError` exactly where a GPU would.

The planner's "fits under budget" and the trainer's OOM recovery are only trustworthy if they are exercised;
CI has no GPU, so the tracker checks every new storage against a byte budget and raises the same exception
class CUDA raises (`torch.OutOfMemoryError`, a `RuntimeError` subclass that can be built from a message on
any build), with a message shaped like the CUDA caching allocator's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .values import format_bytes


@dataclass(frozen=True)
class Budget:
    """At most `limit_bytes` of live storage; the allocation that would pass it fails."""

    limit_bytes: int

    def __post_init__(self) -> None:
        if self.limit_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {self.limit_bytes}")

    def check(self, live_bytes: int, request_bytes: int, live_by_component: Mapping[str, int]) -> None:
        """Raise `torch.OutOfMemoryError` when `request_bytes` more would take live bytes over the limit."""
        if live_bytes + request_bytes > self.limit_bytes:
            raise out_of_memory_error(request_bytes, self.limit_bytes, live_bytes, live_by_component)


def out_of_memory_error(
    request_bytes: int, limit_bytes: int, live_bytes: int, live_by_component: Mapping[str, int]
) -> torch.OutOfMemoryError:
    """The error a simulated device raises; the message names what was live, component by component."""
    parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in live_by_component.items())
    return torch.OutOfMemoryError(
        f"Simulated device out of memory. Tried to allocate {format_bytes(request_bytes)}. "
        f"Simulated device budget of {format_bytes(limit_bytes)}: {format_bytes(live_bytes)} live "
        f"({parts}); {format_bytes(limit_bytes - live_bytes)} free."
    )
