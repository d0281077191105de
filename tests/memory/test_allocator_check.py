"""The allocator model replayed over torch's recorded allocator history (memory/allocator_check.py): the
history read as requests, answers worked out by hand, and every reason a history is not replayed.
On a GPU, `memtrain profile` replays its own run (tests/gpu/test_cuda_only.py)."""

from __future__ import annotations

from typing import Any

import pytest

from memtrain.commands.profile import allocator_model_line
from memtrain.memory.allocator_check import AllocatorModelCheck, check_allocator_model, history_events
from memtrain.memory.caching_allocator import EMPTY_CACHE

MiB = 2**20


def entry(action: str, addr: int, size: int, **extra: Any) -> dict[str, Any]:
    """One entry as torch's snapshot lists it (`device_traces`), without the frames."""
    return {"action": action, "addr": addr, "size": size, "stream": 0, **extra}


# A small request, a 3 MiB one, the small one freed and a second small one at the same address: by the
# allocator's rules a 2 MiB small segment and a 20 MiB large one (under 10 MiB), 3 MiB + 512 B live at the end.
TRACE = [
    entry("segment_alloc", 1000, 2 * MiB),
    entry("alloc", 1000, 1000),
    entry("segment_alloc", 9000, 20 * MiB),
    entry("alloc", 9000, 3 * MiB),
    entry("free_requested", 1000, 1000),
    entry("free_completed", 1000, 1000),
    entry("alloc", 1000, 100),
    entry("alloc", 5000, 0),  # a zero-byte request: no block
]


def test_the_history_reads_as_requests_and_frees() -> None:
    # Each alloc a new storage (the address is reused by index 6), its free at "free_completed" only.
    assert history_events(TRACE) == [(1, 1000), (3, 3 * MiB), (1, 0), (6, 100)]


def test_a_replay_against_answers_by_hand() -> None:
    check = check_allocator_model(
        TRACE, held_at_start=0, reserved_bytes=24 * MiB, allocated_bytes=3 * MiB + 512, settings=""
    )
    assert check.reason is None
    assert check.replayed_reserved_bytes == 22 * MiB and check.replayed_allocated_bytes == 3 * MiB + 512
    assert check.reserved_error == pytest.approx(-2 / 24)
    line = allocator_model_line(check)
    assert "22.00 MiB" in line and "24.00 MiB" in line and "-8.33%" in line, line


def test_the_allocator_settings_reach_the_replay() -> None:
    # 12 MiB: a segment of its own by default; with expandable segments one 20 MiB page of the large pool.
    trace = [entry("alloc", 0, 12 * MiB)]

    def reserved(settings: str) -> int | None:
        return check_allocator_model(
            trace, held_at_start=0, reserved_bytes=1, allocated_bytes=1, settings=settings
        ).replayed_reserved_bytes

    assert reserved("") == 12 * MiB
    assert reserved("expandable_segments:True") == 20 * MiB
    # max_split_size: a freed 100 MiB block is not split for a 30 MiB request under it (a new segment)
    split = [entry("alloc", 0, 100 * MiB), entry("free_completed", 0, 100 * MiB), entry("alloc", 1, 30 * MiB)]
    check = check_allocator_model(
        split, held_at_start=0, reserved_bytes=1, allocated_bytes=1, settings="max_split_size_mb:64"
    )
    assert check.replayed_reserved_bytes == 130 * MiB


def test_the_replay_starts_after_an_empty_cache_that_gave_everything_back() -> None:
    # A probe before the run (a 12 MiB segment, emptied), on a device that held 2 MiB when the history began
    # and gave them back too: the replay is the run's alone, as if the history began after it.
    probe = [
        entry("segment_alloc", 50_000, 12 * MiB),
        entry("alloc", 50_000, 11 * MiB),
        entry("free_completed", 50_000, 11 * MiB),
        entry("segment_free", 50_000, 12 * MiB),
        entry("segment_free", 60_000, 2 * MiB),
    ]
    check = check_allocator_model(
        [*probe, *TRACE], held_at_start=2 * MiB, reserved_bytes=22 * MiB, allocated_bytes=1, settings=""
    )
    assert check.reason is None and check.reserved_error == 0.0
    assert check.replayed_allocated_bytes == 3 * MiB + 512


def test_an_empty_cache_while_a_workspace_lives_is_replayed() -> None:
    # A workspace of 64 KiB stays live (as cuBLAS's does) while a probe's 12 MiB segment is emptied: the
    # empty_cache gives back only the free segment; the run's small request then shares the workspace's.
    probe = [
        entry("segment_alloc", 70_000, 2 * MiB),
        entry("alloc", 70_000, 64 * 1024),
        entry("segment_alloc", 50_000, 12 * MiB),
        entry("alloc", 50_000, 11 * MiB),
        entry("free_completed", 50_000, 11 * MiB),
        entry("segment_free", 50_000, 12 * MiB),
    ]
    run = [entry("alloc", 1000, 1000), entry("alloc", 9000, 3 * MiB)]
    assert history_events([*probe, *run])[2:] == [(3, 0), (EMPTY_CACHE, 0), (6, 1000), (7, 3 * MiB)]
    check = check_allocator_model(
        [*probe, *run], held_at_start=0, reserved_bytes=22 * MiB, allocated_bytes=1, settings=""
    )
    assert check.reason is None and check.replayed_reserved_bytes == 22 * MiB  # 2 small + 20 large
    assert check.replayed_allocated_bytes == 64 * 1024 + 1024 + 3 * MiB


@pytest.mark.parametrize(
    ("trace", "held", "settings", "reason"),
    [
        (TRACE, 4096, "", "held 4096 reserved bytes before the history began and kept some"),
        (TRACE * 20_000, 0, "", "kept only its last 100000 entries"),
        (
            [*TRACE, entry("segment_free", 1000, 2 * MiB)],
            0,
            "expandable_segments:True",
            "returned memory to the driver with expandable segments",
        ),
        ([*TRACE, entry("alloc", 7000, 64, stream=7)], 0, "", "allocations on 2 streams"),
        ([*TRACE, entry("alloc", 7000, 64, pool_id=(1, 2))], 0, "", "private memory pool"),
        (TRACE, 0, "roundup_power2_divisions:4", "settings the model lacks: roundup_power2_divisions"),
        (TRACE, 0, "backend:cudaMallocAsync", "settings the model lacks: backend"),
    ],
    ids=["held", "truncated", "unmapped", "streams", "pool", "rounding", "async"],
)
def test_a_history_that_cannot_stand_for_the_run_is_not_replayed(
    trace: list[dict[str, Any]], held: int, settings: str, reason: str
) -> None:
    check = check_allocator_model(
        trace, held_at_start=held, reserved_bytes=5, allocated_bytes=3, settings=settings
    )
    assert check.reason is not None and reason in check.reason, check.reason
    assert check.replayed_reserved_bytes is None and check.reserved_error is None
    assert (check.reserved_bytes, check.allocated_bytes) == (5, 3)
    assert allocator_model_line(check) == f"allocator model: not replayed ({check.reason})"


def test_the_check_is_a_plain_record_for_memory_json() -> None:
    check = AllocatorModelCheck(10, 8, 11, 8)
    assert AllocatorModelCheck(**check.__dict__) == check
    assert check.reserved_error == pytest.approx(0.1)
