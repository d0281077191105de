"""The CUDA caching allocator's own numbers, to sit beside the tracker's storage counts.

The tracker counts tensor storages. The allocator rounds them up, caches freed blocks (reserved minus
allocated), can fragment so that an allocation fails with plenty reserved, and the CUDA context takes
device memory outside both. These functions read those numbers. Every function also works on a CPU-only
build: it returns None, or a result that says why the number is unavailable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import _torch_private
from .values import format_bytes

Device = torch.device | str | int | None
HISTORY_ENTRIES = 100_000  # the memory history's ring buffer: older entries are dropped


@dataclass(frozen=True)
class AllocatorStats:
    """One reading of `torch.cuda.memory_stats`: current and peak bytes since the last peak reset."""

    allocated_bytes: int
    reserved_bytes: int
    active_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    num_alloc_retries: int
    num_ooms: int
    inactive_split_bytes: int

    @property
    def fragmentation(self) -> float:
        """Share of reserved memory lying in split blocks that are cached but unused."""
        return self.inactive_split_bytes / self.reserved_bytes if self.reserved_bytes else 0.0


@dataclass(frozen=True)
class HistoryResult:
    """Outcome of a memory-history call: `detail` is the file written, or why nothing happened."""

    ok: bool
    detail: str


def cuda_unavailable_reason() -> str | None:
    """None when CUDA can be used, else a sentence saying why not."""
    if torch.cuda.is_available():
        return None
    built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"CUDA is not available (torch {torch.__version__}, {built})"


def allocator_stats(device: Device = None) -> AllocatorStats | None:
    """The caching allocator's counters for `device`, or None without CUDA."""
    if cuda_unavailable_reason() is not None:
        return None
    s = torch.cuda.memory_stats(device)
    return AllocatorStats(
        allocated_bytes=s.get("allocated_bytes.all.current", 0),
        reserved_bytes=s.get("reserved_bytes.all.current", 0),
        active_bytes=s.get("active_bytes.all.current", 0),
        peak_allocated_bytes=s.get("allocated_bytes.all.peak", 0),
        peak_reserved_bytes=s.get("reserved_bytes.all.peak", 0),
        peak_active_bytes=s.get("active_bytes.all.peak", 0),
        num_alloc_retries=s.get("num_alloc_retries", 0),
        num_ooms=s.get("num_ooms", 0),
        inactive_split_bytes=s.get("inactive_split_bytes.all.current", 0),
    )


def context_bytes(device: Device = None) -> int | None:
    """Device memory in use outside the caching allocator (CUDA context, kernels, other processes).

    Call it at start, before the model is on the device: later it also includes cuBLAS/NCCL workspaces.
    """
    if cuda_unavailable_reason() is not None:
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def expandable_segments_enabled() -> bool:
    """Whether the allocator maps growable segments (which all but removes fragmentation)."""
    try:
        settings = _torch_private.allocator_settings()
    except AttributeError:  # torch older than the pinned one: only the environment can say
        return expandable_segments_in_environment()
    return _expandable(settings)


def expandable_segments_in_environment() -> bool:
    """Whether this process's environment asks for expandable segments (PYTORCH_ALLOC_CONF, else
    PYTORCH_CUDA_ALLOC_CONF), read now: what a run launched from it gets, without a GPU here."""
    return _expandable(os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))


def _expandable(settings: str) -> bool:
    return allocator_options(settings).get("expandable_segments", "").lower() == "true"


def allocator_options(settings: str) -> dict[str, str]:
    """The options of an allocator settings string (PYTORCH_ALLOC_CONF's syntax: `key:value,key:value`)."""
    return dict(item.split(":", 1) for item in settings.replace(" ", "").split(",") if ":" in item)


def fragmentation_warning(stats: AllocatorStats | None = None, threshold: float = 0.25) -> str | None:
    """A warning when expandable segments are off and fragmentation is high (or allocations were retried)."""
    stats = stats if stats is not None else allocator_stats()
    if stats is None or expandable_segments_enabled():
        return None
    if stats.fragmentation <= threshold and stats.num_alloc_retries == 0:
        return None
    return (
        f"CUDA memory is fragmented: {format_bytes(stats.inactive_split_bytes)} of "
        f"{format_bytes(stats.reserved_bytes)} reserved ({stats.fragmentation:.0%}) sits in unusable split "
        f"blocks and {stats.num_alloc_retries} allocations had to free the cache and retry. Set "
        "PYTORCH_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF on older torch) before start."
    )


def start_memory_history(max_entries: int = HISTORY_ENTRIES) -> HistoryResult:
    """Record every CUDA alloc/free with its stack, for `dump_memory_history`."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        return HistoryResult(False, reason)
    _torch_private.record_memory_history(True, max_entries)
    return HistoryResult(True, f"recording up to {max_entries} allocator events")


def dump_memory_history(path: str | os.PathLike[str], stop: bool = True) -> HistoryResult:
    """Write the recorded history as a pickle to open at https://pytorch.org/memory_viz; stop recording."""
    reason = cuda_unavailable_reason()
    if reason is not None:
        return HistoryResult(False, reason)
    _torch_private.dump_memory_snapshot(os.fspath(path))
    if stop:
        _torch_private.record_memory_history(False, 0)
    return HistoryResult(True, os.fspath(path))
