"""The caching-allocator model against answers worked out by hand from the allocator's rules."""

from __future__ import annotations

import pytest

from memtrain.memory.caching_allocator import (
    EMPTY_CACHE,
    CachingAllocator,
    Event,
    replay,
    round_size,
    segment_size,
)

MiB = 2**20


def alloc(*sizes: tuple[int, int]) -> list[Event]:
    return list(sizes)


def test_rounding_and_segment_sizes() -> None:
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(MiB) == 2 * MiB  # small pool
    assert segment_size(MiB + 512) == 20 * MiB  # large pool, under 10 MiB
    assert segment_size(10 * MiB + 1) == 12 * MiB  # its own segment, rounded to 2 MiB
    one = replay([(1, 1)])
    assert (one.allocated_peak, one.blocks_peak, one.reserved_peak) == (1, 512, 2 * MiB)


def test_small_requests_share_a_2mib_segment() -> None:
    # Two 1 MiB requests fill one 2 MiB segment (the first one's 1 MiB remainder is split off); a third
    # needs another segment.
    assert replay([(1, MiB), (2, MiB)]).reserved_peak == 2 * MiB
    assert replay([(1, MiB), (2, MiB), (3, MiB)]).reserved_peak == 4 * MiB
    # Just over 1 MiB is a large request: a 20 MiB segment.
    assert replay([(1, MiB + 1)]).reserved_peak == 20 * MiB


def test_5mib_request_splits_a_20mib_segment_and_reuses_it() -> None:
    events = [(1, 5 * MiB), (2, 5 * MiB)]  # both in one 20 MiB segment: 10 MiB left, split off
    assert replay(events).reserved_peak == 20 * MiB
    events += [(1, 0), (3, 8 * MiB)]  # free blocks 5 MiB and 10 MiB: best fit is the 10 MiB one
    assert replay(events).reserved_peak == 20 * MiB
    events += [(4, 6 * MiB)]  # free now 5 MiB and 2 MiB: neither holds 6 MiB, a new segment
    result = replay(events)
    assert (result.reserved_peak, result.allocated_peak) == (40 * MiB, 19 * MiB)
    assert result.reserved_at_allocated_peak == 40 * MiB


def test_best_fit_takes_the_smallest_free_block() -> None:
    # Two segments, 12 MiB and 16 MiB, both freed: an 11 MiB request takes the 12 MiB one, so a
    # following 15 MiB request still finds the 16 MiB one (first fit would have needed a new segment).
    events = [(1, 16 * MiB), (2, 12 * MiB), (1, 0), (2, 0), (3, 11 * MiB), (4, 15 * MiB)]
    assert replay(events).reserved_peak == 28 * MiB


def test_large_remainder_of_one_mib_is_not_split() -> None:
    # 11 MiB -> a 12 MiB segment, remainder 1 MiB: not over 1 MiB, so the whole block is handed out.
    result = replay([(1, 11 * MiB), (2, 512)])
    assert result.blocks_peak == 12 * MiB + 512
    assert result.reserved_peak == 12 * MiB + 2 * MiB  # the 512 B goes to the small pool


def test_oversize_blocks_are_not_split_under_max_split_size() -> None:
    events = [(1, 100 * MiB), (1, 0), (2, 30 * MiB)]
    assert replay(events).reserved_peak == 100 * MiB  # split: 30 MiB taken, 70 MiB left
    assert replay(events, max_split_size=64 * MiB).reserved_peak == 130 * MiB  # never split: new segment
    # an oversize request takes an oversize block only within 20 MiB of its size
    near = [(1, 100 * MiB), (1, 0), (2, 90 * MiB)]
    assert replay(near, max_split_size=64 * MiB).reserved_peak == 100 * MiB
    far = [(1, 100 * MiB), (1, 0), (2, 70 * MiB)]
    assert replay(far, max_split_size=64 * MiB).reserved_peak == 170 * MiB


def test_freed_neighbours_coalesce() -> None:
    # 5 + 5 + 5 MiB in one 20 MiB segment (5 MiB tail free); freeing the first two makes one 10 MiB
    # block, which holds a 9 MiB request: no new segment.
    events = [(1, 5 * MiB), (2, 5 * MiB), (3, 5 * MiB), (1, 0), (2, 0), (4, 9 * MiB)]
    assert replay(events).reserved_peak == 20 * MiB
    # freeing the first and the third leaves two 5 MiB holes apart (+ the tail, merged with the third)
    apart = [(1, 5 * MiB), (2, 5 * MiB), (3, 5 * MiB), (1, 0), (3, 0), (4, 11 * MiB)]
    assert replay(apart).reserved_peak == 32 * MiB


def test_expandable_segments_grow_one_segment_in_pages() -> None:
    growing = [(1, 100 * MiB), (1, 0), (2, 110 * MiB), (2, 0), (3, 120 * MiB)]
    # default: each larger request needs a segment of its own
    assert replay(growing).reserved_peak == 330 * MiB
    # expandable: the free tail grows by 20 MiB pages
    assert replay(growing, expandable_segments=True).reserved_peak == 120 * MiB
    # pages: 30 MiB mapped as two 20 MiB pages; the small pool maps 2 MiB pages
    assert replay([(1, 30 * MiB)], expandable_segments=True).reserved_peak == 40 * MiB
    assert replay([(1, 3 * 2**19)], expandable_segments=True).reserved_peak == 20 * MiB  # 1.5 MiB: large
    four_small = [(i, 600 * 2**10) for i in range(4)]  # 2.34 MiB in the small pool: two 2 MiB pages
    assert replay(four_small, expandable_segments=True).reserved_peak == 4 * MiB


def test_expandable_prefers_a_hole_to_the_tail() -> None:
    # A 40 MiB hole in the middle and a free tail: a 30 MiB request takes the hole, the tail keeps growing.
    events = [(1, 40 * MiB), (2, 40 * MiB), (3, 10 * MiB), (1, 0), (3, 0), (4, 30 * MiB), (5, 20 * MiB)]
    result = replay(events, expandable_segments=True)
    assert result.reserved_peak == 100 * MiB


def test_expandable_tail_serves_an_oversize_request_without_new_pages() -> None:
    # 100 MiB mapped and freed (the free tail); a 30 MiB request under max_split_size 64 MiB may not take
    # that oversize block as a free block, but the segment hands the tail out as it grows: no new page.
    events = [(1, 100 * MiB), (1, 0), (2, 30 * MiB)]
    assert replay(events, expandable_segments=True, max_split_size=64 * MiB).reserved_peak == 100 * MiB


@pytest.mark.parametrize("expandable", [False, True])
def test_reserved_never_below_allocated(expandable: bool) -> None:
    sizes = [3 * MiB, 700 * 2**10, 33 * MiB, 12 * MiB + 7, 100, 48 * MiB]
    events: list[Event] = []
    for step in range(4):
        for i, size in enumerate(sizes):
            events.append((10 * step + i, size * (step + 1)))
        events += [(10 * step + i, 0) for i in range(0, len(sizes), 2)]
    result = replay(events, expandable_segments=expandable)
    assert result.reserved_peak >= result.blocks_peak >= result.allocated_peak > 0
    assert result.reserved_at_allocated_peak <= result.reserved_peak


def test_double_allocation_is_an_error() -> None:
    with pytest.raises(ValueError, match="allocated twice"):
        replay([(1, 10), (1, 10)])


def test_empty_cache_returns_only_the_segments_without_live_blocks() -> None:
    # 5 MiB and 3 MiB share a 20 MiB segment, 13 MiB takes one of 14 MiB: with the 3 MiB one still live only
    # the 14 MiB segment goes back; the peak keeps what was reserved before.
    events = [(1, 5 * MiB), (2, 3 * MiB), (3, 13 * MiB), (1, 0), (3, 0), (EMPTY_CACHE, 0)]
    result = replay(events)
    assert (result.reserved_peak, result.reserved_end, result.blocks_end) == (34 * MiB, 20 * MiB, 3 * MiB)
    assert replay([*events, (2, 0), (EMPTY_CACHE, 0)]).reserved_end == 0
    with pytest.raises(ValueError, match="expandable segments"):
        CachingAllocator(expandable_segments=True).empty_cache()
