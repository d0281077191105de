"""A model of PyTorch's CUDA caching allocator, replayed over a sequence of allocations and frees.

Why: a GPU runs out of *reserved* memory (the segments the allocator holds from the driver), not of
allocated bytes (the live tensors the tracker counts). The gap is the allocator's rounding and
fragmentation, which depends on the order and sizes of the step's allocations, so it is replayed here
rather than guessed as a fraction.

Modelled, from c10/cuda/CUDACachingAllocator.cpp (torch 2.x; constants of CachingDeviceAllocator.h):
- every request rounded up to a multiple of 512 B (`kMinBlockSize`);
- two pools: requests of at most 1 MiB (`kSmallSize`) are served from 2 MiB segments (`kSmallBuffer`);
  larger ones from 20 MiB segments (`kLargeBuffer`) below 10 MiB (`kMinLargeAlloc`), else from a segment
  of the request rounded up to 2 MiB (`kRoundLarge`);
- best fit: the smallest free block of the pool that holds the request (ties: the older segment, then
  the lower address); the allocated part takes the block's low end and the rest stays a free block when
  it is split (small pool: a remainder of at least 512 B; large pool: a remainder over 1 MiB and a
  request under `max_split_size`);
- `max_split_size` (unlimited by default): a request below it never takes a free block at or above it,
  one at or above it takes such a block only within `max_non_split_rounding` of its size;
- a freed block merges with free neighbours of its segment; segments are returned only by
  `empty_cache` (an `EMPTY_CACHE` event: every segment with no live block), which a training step never
  calls, so over a step's replay reserved bytes only grow;
- `expandable_segments:True`: one segment per pool whose mapped size grows in pages (2 MiB for the small
  pool, 20 MiB for the large: `ExpandableSegment`'s `segment_size`). A request takes the best-fitting
  free block that is not the segment's free tail (the tail can grow, so it is the last choice); when none
  fits, pages are mapped at the end (joined with a free tail), and any remainder of 512 B or more is
  split off. Reserved = the mapped pages.

Not modelled: several streams (one stream: each stream has its own blocks and expandable segment),
events and `record_stream` (a block is reusable as soon as it is freed), CUDA graph private pools,
`garbage_collection_threshold`, `roundup_power2_divisions`, `per_process_memory_fraction` and the path
taken when the driver refuses a segment (free unsplit cached segments and retry): the replay has no
memory cap, so near a GPU's limit the real allocator can do with less than the replayed reserved bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

MiB = 2**20
MIN_BLOCK = 512
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB
LARGE_BUFFER = 20 * MiB
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB

Event = tuple[int, int]
"""(storage id, bytes): an allocation of `bytes` when it is positive, the free of that storage when 0;
`(EMPTY_CACHE, 0)`: `torch.cuda.empty_cache()`."""
EMPTY_CACHE = -1


@dataclass(frozen=True)
class Replay:
    """What a replayed sequence held: live requested bytes (what the tracker counts), the allocator's
    live blocks (`torch.cuda.max_memory_allocated`'s measure) and its segments (`max_memory_reserved`);
    after the last event its live blocks and segments (`memory_allocated`, `memory_reserved`)."""

    allocated_peak: int
    reserved_peak: int
    reserved_at_allocated_peak: int
    blocks_peak: int
    blocks_end: int
    reserved_end: int


def round_size(size: int) -> int:
    """A request as the allocator serves it: at least 512 B, in multiples of 512 B."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment a (rounded) request that found no free block makes (`get_allocation_size`)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "free", "next", "prev", "segment", "size", "small")

    def __init__(self, addr: int, size: int, segment: int, small: bool, prev: _Block | None = None) -> None:
        self.addr, self.size, self.segment, self.small = addr, size, segment, small
        self.prev, self.next = prev, None
        self.free = False
        if prev is not None:
            prev.next = self

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.addr)


class _Pool:
    """The free blocks of one pool in best-fit order, and (expandable) its one growing segment."""

    def __init__(self, small: bool, page: int) -> None:
        self.small, self.page = small, page
        self.free: list[tuple[int, int, int]] = []
        self.blocks: dict[int, _Block] = {}  # free blocks by address
        self.last: _Block | None = None  # expandable: the block at the end of the mapped range

    def add(self, block: _Block) -> None:
        block.free = True
        bisect.insort(self.free, block.key())
        self.blocks[block.addr] = block

    def remove(self, block: _Block) -> None:
        del self.free[bisect.bisect_left(self.free, block.key())]
        del self.blocks[block.addr]
        block.free = False


class CachingAllocator:
    """The allocator's state over a replay; `malloc`/`free` by storage id (see the module docstring)."""

    def __init__(
        self,
        expandable_segments: bool = False,
        max_split_size: int | None = None,
        max_non_split_rounding: int = LARGE_BUFFER,
    ) -> None:
        self.expandable = expandable_segments
        self.max_split = max_split_size
        self.max_rounding = max_non_split_rounding
        self.pools = (_Pool(True, SMALL_BUFFER), _Pool(False, LARGE_BUFFER))
        self.reserved = 0
        self.allocated = 0  # requested bytes of live storages
        self.blocks = 0  # bytes of live blocks
        self._live: dict[int, tuple[_Block, int]] = {}
        self._next_addr = 0
        self._segments = 0

    def malloc(self, sid: int, nbytes: int) -> None:
        if sid in self._live:
            raise ValueError(f"storage {sid} allocated twice without a free")
        size = round_size(nbytes)
        pool = self.pools[0] if size <= SMALL_SIZE else self.pools[1]
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size) if self.expandable else self._new_segment(pool, segment_size(size))
        elif block.free:
            pool.remove(block)
        if self._should_split(pool, block, size):
            rest = _Block(block.addr + size, block.size - size, block.segment, block.small)
            rest.next, block.next = block.next, rest
            rest.prev = block
            if rest.next is not None:
                rest.next.prev = rest
            block.size = size
            if pool.last is block:
                pool.last = rest
            pool.add(rest)
        self._live[sid] = (block, nbytes)
        self.allocated += nbytes
        self.blocks += block.size

    def free(self, sid: int) -> bool:
        """Free storage `sid`; False when it is not live here (allocated before the replay began)."""
        found = self._live.pop(sid, None)
        if found is None:
            return False
        block, nbytes = found
        self.allocated -= nbytes
        self.blocks -= block.size
        pool = self.pools[0] if block.small else self.pools[1]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.remove(neighbour)
                self._merge(pool, block, neighbour)
        pool.add(block)
        return True

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` without expandable segments: every segment with no live block (one free
        block, merged whole) goes back to the driver."""
        if self.expandable:
            raise ValueError("empty_cache with expandable segments (pages unmapped) is not modelled")
        for pool in self.pools:
            for block in [b for b in pool.blocks.values() if b.prev is None and b.next is None]:
                pool.remove(block)
                self.reserved -= block.size

    def _merge(self, pool: _Pool, block: _Block, other: _Block) -> None:
        if other is block.prev:
            block.addr, block.prev = other.addr, other.prev
            if block.prev is not None:
                block.prev.next = block
        else:
            block.next = other.next
            if block.next is not None:
                block.next.prev = block
            if pool.last is other:
                pool.last = block
        block.size += other.size

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        if i == len(pool.free):
            return None
        block = pool.blocks[pool.free[i][2]]
        if self.expandable and block is pool.last and i + 1 < len(pool.free):
            block = pool.blocks[pool.free[i + 1][2]]  # the growable tail is the last choice
        if self.max_split is not None:
            if size < self.max_split <= block.size:
                return None
            if size >= self.max_split and block.size >= size + self.max_rounding:
                return None
        return block

    def _should_split(self, pool: _Pool, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if pool.small or self.expandable:
            return remaining >= MIN_BLOCK
        return (self.max_split is None or size < self.max_split) and remaining > SMALL_SIZE

    def _new_segment(self, pool: _Pool, size: int) -> _Block:
        self._segments += 1
        block = _Block(self._next_addr, size, self._segments, pool.small)
        self._next_addr += size
        self.reserved += size
        return block

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """Expandable: map pages at the end of the pool's segment, joined with a free tail."""
        tail = pool.last
        have = tail.size if tail is not None and tail.free else 0
        pages = max(0, -(-(size - have) // pool.page) * pool.page)  # 0: a free tail refused by max_split_size
        self.reserved += pages
        if pool.last is None:
            self._segments += 1
            pool.last = _Block(self._next_addr, pages, self._segments, pool.small)
            self._next_addr += 2**50  # the segment's address range: room to grow
            return pool.last
        assert tail is not None
        if tail.free:
            pool.remove(tail)
            tail.size += pages
            return tail
        pool.last = _Block(tail.addr + tail.size, pages, tail.segment, pool.small, prev=tail)
        return pool.last


def replay(
    events: Iterable[Event],
    expandable_segments: bool = False,
    max_split_size: int | None = None,
    max_non_split_rounding: int = LARGE_BUFFER,
) -> Replay:
    """Run `events` through a fresh allocator; frees of storages it never saw allocated are skipped."""
    allocator = CachingAllocator(expandable_segments, max_split_size, max_non_split_rounding)
    peak = reserved_at_peak = blocks_peak = reserved_peak = 0
    malloc, free = allocator.malloc, allocator.free
    for sid, nbytes in events:
        if sid == EMPTY_CACHE:
            allocator.empty_cache()
        elif nbytes:
            malloc(sid, nbytes)
            if allocator.allocated > peak:
                peak, reserved_at_peak = allocator.allocated, allocator.reserved
            if allocator.blocks > blocks_peak:
                blocks_peak = allocator.blocks
            if allocator.reserved > reserved_peak:
                reserved_peak = allocator.reserved
        else:
            free(sid)
    return Replay(peak, reserved_peak, reserved_at_peak, blocks_peak, allocator.blocks, allocator.reserved)
