"""memtrain's model of the CUDA caching allocator (caching_allocator.py) replayed over the allocations a run
really made, against what the real allocator reserved: the planner's reserved bytes stand on that model,
and this is the one check of it that needs no prediction in between.

Why from torch's memory history (`torch.cuda.memory._record_memory_history`, which `memtrain profile`
records anyway for its memory_viz snapshot): it lists every request the allocator served, with its
requested size and its address, in order. Replayed from an empty allocator, the model must reserve what
the allocator reserved at the end (`memory_reserved`; an `empty_cache` in the history, the step-time
probe's, is replayed as one) and hold the same live blocks (`memory_allocated`, every block rounded as the
allocator rounds it; a mismatch there means a request or a free was read wrong).

The replay starts at the last moment the allocator held nothing: the start of the history, or an
`empty_cache` that gave every segment back. No replay, and the reason instead, when the history cannot
stand for the run from there: the device held memory from before the recording to the end, the history's
ring buffer dropped its first entries, segments were given back with expandable segments on (pages
unmapped: not modelled), allocations ran on several streams or in a private pool (CUDA graphs), or the
allocator runs with settings the model lacks. An allocation retried after the allocator freed its cache
(near the device's limit) is replayed as an `empty_cache`, which frees every unused segment where the
allocator may free fewer: the comparison shows it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _torch_private
from .caching_allocator import EMPTY_CACHE, LARGE_BUFFER, Event, MiB, replay
from .cuda_stats import HISTORY_ENTRIES, allocator_options, allocator_stats

NOT_MODELLED = ("roundup_power2_divisions", "garbage_collection_threshold", "backend")
GROWN = ("segment_alloc", "segment_map")  # the allocator took memory from the driver
RETURNED = ("segment_free", "segment_unmap")  # and gave it back


@dataclass(frozen=True)
class AllocatorModelCheck:
    """The model's replay of the recorded requests beside the allocator's own bytes at the end of the run;
    the replayed fields are None, and `reason` says why, when the history cannot be replayed whole."""

    reserved_bytes: int
    allocated_bytes: int
    replayed_reserved_bytes: int | None = None
    replayed_allocated_bytes: int | None = None
    reason: str | None = None

    @property
    def reserved_error(self) -> float | None:
        """(replayed - real) / real reserved bytes."""
        if self.replayed_reserved_bytes is None or not self.reserved_bytes:
            return None
        return (self.replayed_reserved_bytes - self.reserved_bytes) / self.reserved_bytes


def history_events(trace: Iterable[Mapping[str, Any]]) -> list[Event]:
    """The requests of torch's allocator history (the entries of `torch.cuda.memory._snapshot()`'s
    `device_traces[device]`) as replay events: each "alloc" a new storage of its requested `size`, and its
    "free_completed" (the block reusable again; "free_requested" precedes it while another stream still
    uses the block) the free of the storage last allocated at that address, and segments given back to the
    driver an `empty_cache`. The allocator's other actions (new segments, snapshots, OOMs) are its answers,
    not requests: the replay makes its own."""
    events: list[Event] = []
    live: dict[int, int] = {}
    for serial, entry in enumerate(trace):
        action = entry.get("action")
        if action == "alloc" and entry["size"] > 0:
            live[entry["addr"]] = serial
            events.append((serial, int(entry["size"])))
        elif action == "free_completed" and entry["addr"] in live:
            events.append((live.pop(entry["addr"]), 0))
        elif action in RETURNED and (not events or events[-1] != (EMPTY_CACHE, 0)):
            events.append((EMPTY_CACHE, 0))  # one `empty_cache` returns its segments one entry each
    return events


def check_allocator_model(
    trace: Sequence[Mapping[str, Any]],
    *,
    held_at_start: int,
    reserved_bytes: int,
    allocated_bytes: int,
    settings: str,
    max_entries: int = HISTORY_ENTRIES,
) -> AllocatorModelCheck:
    """Replay `trace` (recorded from a device that held `held_at_start` reserved bytes, with at most
    `max_entries` kept) under the allocator `settings` (PYTORCH_ALLOC_CONF's syntax) from the last moment
    the allocator held nothing, and set it beside the allocator's `reserved_bytes` and `allocated_bytes`
    at the end."""
    options = allocator_options(settings)
    start = _empty_since(trace, held_at_start)
    if len(trace) >= max_entries:
        reason: str | None = f"the history kept only its last {max_entries} entries"
    elif start is None:
        reason = f"the device held {held_at_start} reserved bytes before the history began and kept some"
    else:
        reason = _why_not_replayable(trace[start:], options)
    if reason is not None or start is None:
        return AllocatorModelCheck(reserved_bytes, allocated_bytes, reason=reason)
    split = options.get("max_split_size_mb")
    rounding = options.get("max_non_split_rounding_mb")
    replayed = replay(
        history_events(trace[start:]),
        expandable_segments=options.get("expandable_segments", "").lower() == "true",
        max_split_size=int(split) * MiB if split else None,
        max_non_split_rounding=int(rounding) * MiB if rounding else LARGE_BUFFER,
    )
    return AllocatorModelCheck(reserved_bytes, allocated_bytes, replayed.reserved_end, replayed.blocks_end)


def check_recorded_run(device: torch.device, held_at_start: int) -> AllocatorModelCheck | None:
    """The check over this process's history on `device` (None without CUDA), recorded since the device held
    `held_at_start` reserved bytes; call it while the history still records (`dump_memory_history` stops it)."""
    stats = allocator_stats(device)
    if stats is None:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    traces = _torch_private.memory_snapshot().get("device_traces", [])
    return check_allocator_model(
        traces[index] if index < len(traces) else [],
        held_at_start=held_at_start,
        reserved_bytes=stats.reserved_bytes,
        allocated_bytes=stats.allocated_bytes,
        settings=_torch_private.allocator_settings(),
    )


def _empty_since(trace: Sequence[Mapping[str, Any]], held_at_start: int) -> int | None:
    """The index of the entry after the last moment the allocator held no segment (so no block either), from
    which a replay starts as the allocator did: 0 when it started empty, after an `empty_cache` that gave
    everything back (the step-time probe's, before the model is built), or None when it never held nothing."""
    reserved = held_at_start
    start = 0 if held_at_start == 0 else None
    for index, entry in enumerate(trace):
        action = entry.get("action")
        if action in GROWN:
            reserved += int(entry["size"])
        elif action in RETURNED:
            reserved -= int(entry["size"])
            if reserved <= 0:
                start = index + 1
    return start


def _why_not_replayable(trace: Sequence[Mapping[str, Any]], options: Mapping[str, str]) -> str | None:
    """Why `trace`, recorded from an empty allocator, does not replay as the allocator ran, or None."""
    expandable = options.get("expandable_segments", "").lower() == "true"
    if expandable and any(entry.get("action") in RETURNED for entry in trace):
        return "the run returned memory to the driver with expandable segments: not modelled"
    streams = {entry.get("stream", 0) for entry in trace if entry.get("action") == "alloc"}
    if len(streams) > 1:
        return f"allocations on {len(streams)} streams: the model replays one"
    pools = {tuple(entry.get("pool_id", (0, 0))) for entry in trace if entry.get("action") == "alloc"}
    if pools - {(0, 0)}:
        return "allocations in a private memory pool (CUDA graphs): not modelled"
    unmodelled = [key for key in NOT_MODELLED if key in options]
    if unmodelled:
        return f"allocator settings the model lacks: {', '.join(unmodelled)}"
    return None
