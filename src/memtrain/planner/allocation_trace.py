"""The traced step's allocation sequence, and the same sequence at the real model's depth.

Why a sequence: reserved memory (memory/caching_allocator.py) depends on the order and sizes of every
allocation and free, which a peak cannot tell. The planner's trace (activations.trace_step) logs them,
each storage once (`MemoryTracker.record_allocations`), cut at the same block boundaries as its segments.

Why a synthesis: the trace runs a clone of three blocks (first, middle, last), the real model has many
middle blocks. `whole_depth` replays the clone's pieces in the real order, the middle block's once per
real middle block, each repetition with storages of its own. A storage lives from the piece that makes it
to the piece that frees it; a free inside a block refers to a storage of the same block or of a
neighbour at the same distance in the real model (block 1 frees block 0's output; in the real model
block r frees block r-1's). When that neighbour is a middle block but the clone's was the first or last
block, the clone's middle block has the storage that stands for it: the k-th storage made in the same
phase of the middle block and freed at the same distance (matched in order; a storage without match is
left live and counted in `Synthesis.unmatched`). Storages made outside the blocks and freed inside the
middle block are freed by the last repetition; storages of a block freed outside the blocks (the
autocast cache at the end of the forward) are freed in every repetition.

Why two micro-batch sizes: every size is fitted as a + b·tokens between the two traces the activation
fit uses, piece by piece (where a piece's op sequence differs between them, the larger trace's sizes
are used for that piece).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from memtrain.memory.caching_allocator import Event

BLOCK_PHASES = ("fwd.block", "bwd.block")


@dataclass(frozen=True)
class PieceKey:
    """Where a piece of the trace ran: `micro_step` and `phase` as activations.SegmentKey, `block` the
    clone's block index for block phases (else -1); phase "" is outside any segment."""

    micro_step: str = ""
    phase: str = ""
    block: int = -1

    @property
    def in_block(self) -> bool:
        return self.phase in BLOCK_PHASES


Pieces = tuple[tuple[PieceKey, tuple[Event, ...]], ...]
"""The traced step's allocations and frees, in order, cut where its segments begin and end."""


@dataclass(frozen=True)
class AllocationFit:
    """The pieces of two traces with each allocation's bytes as a + b·tokens (frees carry no size), and
    which storages were gradients."""

    keys: tuple[PieceKey, ...]
    ids: tuple[tuple[int, ...], ...]
    intercept: tuple[tuple[float, ...], ...]
    slope: tuple[tuple[float, ...], ...]
    gradients: frozenset[int] = frozenset()

    def at(self, tokens: int, kept_gradients: bool = True) -> Pieces:
        """The pieces at `tokens`. Without `kept_gradients` each gradient is freed at the end of the piece
        that made it: a sharded plan reduce-scatters a block's unsharded gradients into their shards once
        the block's backward is done (the shards are the backend's bytes, by arithmetic)."""
        if not kept_gradients:
            return tuple(
                (key, (*events, *((sid, 0) for sid, n in events if n and sid in self.gradients)))
                for key, events in self.at(tokens)
            )
        return tuple(
            (
                key,
                tuple(
                    (sid, max(1, round(a + b * tokens)) if a or b else 0)
                    for sid, a, b in zip(ids, a_s, b_s, strict=True)
                ),
            )
            for key, ids, a_s, b_s in zip(self.keys, self.ids, self.intercept, self.slope, strict=True)
        )


def fit_allocations(
    small: Pieces, small_tokens: int, large: Pieces, large_tokens: int, gradients: frozenset[int]
) -> AllocationFit:
    """The line through two traces' sequences, piece by piece; a piece whose sequence differs between them
    keeps the larger trace's sizes (a loss cut into chunks of fixed tokens makes more chunks in the larger
    trace). Pieces are compared up to the storages' ids: a storage of the smaller trace is the one the
    larger makes at the same place of a piece that matches, so the pieces after a differing one (whose
    storages took other serials) still match. `gradients`: the larger trace's gradient storages."""
    span = large_tokens - small_tokens
    keys = tuple(k for k, _ in large)
    ids = tuple(tuple(s for s, _ in events) for _, events in large)
    comparable = span != 0 and tuple(k for k, _ in small) == keys
    matched = _matching_pieces(small, large) if comparable else [False] * len(large)
    intercept: list[tuple[float, ...]] = []
    slope: list[tuple[float, ...]] = []
    for (_, es), (_, el), same in zip(small if comparable else large, large, matched, strict=True):
        if not same:
            intercept.append(tuple(float(n) for _, n in el))
            slope.append((0.0,) * len(el))
            continue
        bs = tuple((nl - ns) / span for (_, ns), (_, nl) in zip(es, el, strict=True))
        slope.append(bs)
        intercept.append(tuple(ns - b * small_tokens for (_, ns), b in zip(es, bs, strict=True)))
    return AllocationFit(keys, ids, tuple(intercept), tuple(slope), gradients)


def _matching_pieces(small: Pieces, large: Pieces) -> list[bool]:
    """Per piece: whether the two traces make and free the same storages in the same order there (each
    storage of the smaller trace standing for the one the larger makes at its place in a matching piece)."""
    twin: dict[int, int] = {}  # the smaller trace's storage -> the larger's, from the matching pieces
    matched: list[bool] = []
    for (_, es), (_, el) in zip(small, large, strict=True):
        found = _twins(es, el, twin, set(twin.values()))
        matched.append(found is not None)
        twin |= found or {}
    return matched


def _twins(
    small: tuple[Event, ...], large: tuple[Event, ...], twin: dict[int, int], taken: set[int]
) -> dict[int, int] | None:
    """The storages one piece makes, the smaller trace's to the larger's; None when the pieces differ: in
    length, in where they allocate, or in which storage a free releases (one made in a matching piece must
    be its twin; any other must not be a twin of another). `taken`: the larger trace's twins so far (a set
    this piece's own are added to)."""
    if len(small) != len(large):
        return None
    made: dict[int, int] = {}
    for (mine, mine_bytes), (theirs, their_bytes) in zip(small, large, strict=True):
        if (mine_bytes > 0) != (their_bytes > 0):
            return None
        if mine_bytes:
            made[mine] = theirs
            taken.add(theirs)
            continue
        known = made.get(mine, twin.get(mine))
        if known != theirs and (known is not None or theirs in taken):
            return None
    return made


@dataclass
class Synthesis:
    """A whole-depth sequence and how many of the clone's frees found no storage to free there."""

    events: list[Event] = field(default_factory=list)
    unmatched: int = 0


def whole_depth(pieces: Pieces, num_blocks: int, depth: int, steps: int = 1) -> Synthesis:
    """The clone's sequence at `num_blocks` blocks (see the module docstring), `steps` training steps in a
    row: what is still live at the end of a step (its gradients) is freed before the next
    (`zero_grad(set_to_none=True)`), as the allocator's cache carries over."""
    return _Synthesizer(pieces, num_blocks, depth).run(steps)


class _Synthesizer:
    def __init__(self, pieces: Pieces, num_blocks: int, depth: int) -> None:
        self.pieces, self.count = pieces, num_blocks
        self.depth = depth if num_blocks > depth else num_blocks
        self.made_in: dict[int, PieceKey] = {}
        freed_in: dict[int, PieceKey] = {}
        for key, events in pieces:
            for sid, nbytes in events:
                (self.made_in if nbytes else freed_in)[sid] = key
        groups: dict[tuple[PieceKey, PieceKey], list[int]] = defaultdict(list)
        for sid, made in self.made_in.items():
            freed = freed_in.get(sid)
            if freed is not None and made.in_block and freed.in_block:
                groups[(made, freed)].append(sid)
        self.groups = groups
        self.rank = {sid: i for members in groups.values() for i, sid in enumerate(members)}

    def run(self, steps: int) -> Synthesis:
        out = Synthesis()
        fresh = itertools.count()
        for _ in range(steps):
            live: dict[tuple[int, int], int] = {}
            reals: dict[int, set[int]] = defaultdict(set)  # the real blocks a clone storage is live for
            for key, events, real, last in self._instances():
                for sid, nbytes in events:
                    if nbytes:
                        live[(sid, real)] = new = next(fresh)
                        reals[sid].add(real)
                        out.events.append((new, nbytes))
                    elif sid in self.made_in:
                        for instance in self._freed(sid, key, real, last, reals[sid]):
                            target = live.pop(instance, None)
                            reals[sid].discard(instance[1])
                            if target is None:
                                out.unmatched += 1
                            else:
                                out.events.append((target, 0))
            out.events += [(target, 0) for target in live.values()]
        return out

    def _instances(self) -> Iterator[tuple[PieceKey, tuple[Event, ...], int, bool]]:
        """(piece, its events, the real block it runs for (-1 outside), whether it is the last repetition)."""
        n = self.count
        for key, events in self.pieces:
            if not key.in_block or n <= self.depth:
                yield key, events, key.block, True
            elif key.block == 0:
                yield key, events, 0, True
            elif key.block == self.depth - 1:
                yield key, events, n - 1, True
            else:
                reals = range(1, n - 1) if key.phase == "fwd.block" else range(n - 2, 0, -1)
                for i, real in enumerate(reals):
                    yield key, events, real, i == n - 3

    def _clone_of(self, real: int) -> int:
        n = self.count
        if n <= self.depth:
            return real
        return 0 if real == 0 else self.depth - 1 if real == n - 1 else 1

    def _freed(self, sid: int, key: PieceKey, real: int, last: bool, live: set[int]) -> list[tuple[int, int]]:
        """The real storages (clone id, real block) that the clone's free of `sid` in `key` frees; `live`:
        the real blocks `sid` is live for."""
        made = self.made_in[sid]
        if not made.in_block:
            return [(sid, -1)] if last or not key.in_block else []
        if not key.in_block:  # every repetition's copy (the autocast cache released after the forward)
            return [(sid, owner) for owner in sorted(live)] or [(sid, made.block)]
        distance = key.block - made.block
        owner = real - distance
        if not 0 <= owner < self.count:
            return [(sid, owner)]
        clone = self._clone_of(owner)
        if clone == made.block:
            return [(sid, owner)]
        stand_in = self._stand_in(sid, made, key, clone, distance)
        return [(stand_in if stand_in is not None else sid, owner)]

    def _stand_in(self, sid: int, made: PieceKey, freed: PieceKey, clone: int, distance: int) -> int | None:
        """The storage of clone block `clone` that plays `sid`'s part (made in the same phase, freed in the
        same phase at the same block distance, in the same order), or None."""
        if not 0 <= clone + distance < self.depth:
            return None
        group = self.groups.get(
            (
                PieceKey(made.micro_step, made.phase, clone),
                PieceKey(freed.micro_step, freed.phase, clone + distance),
            ),
            [],
        )
        k = self.rank.get(sid, -1)
        return group[k] if 0 <= k < len(group) else None
