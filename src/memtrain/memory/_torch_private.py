"""Every private torch API memtrain touches, behind one module.

Private APIs change without deprecation. Keeping them here means one file to fix when the pinned torch moves,
and tests/memory/test_torch_private.py names the torch version and the API that broke.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "TorchDispatchMode",
    "tree_leaves",
    "allocator_settings",
    "dump_memory_snapshot",
    "fake_tensors",
    "record_memory_history",
]


def fake_tensors() -> FakeTensorMode:
    """A mode whose tensors have shapes, dtypes and (meta) storages but no memory.

    A MemoryTracker used inside it counts a training step of any size on the CPU, byte for byte as the
    real step would (the storages it sees are the same, only on the meta device).
    """
    return FakeTensorMode()


def record_memory_history(enabled: bool, max_entries: int) -> None:
    """Start (or stop) the CUDA caching allocator's alloc/free history with stack traces."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator snapshot (with the recorded history) as a pickle for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def allocator_settings() -> str:
    """The caching allocator's settings string, e.g. "expandable_segments:True" (env var or set at runtime)."""
    return str(torch._C._accelerator_getAllocatorSettings())
