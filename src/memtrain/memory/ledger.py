"""Live tensor storages, each counted once, with the component it currently belongs to.

Why storages and not tensors: views, tied weights and tensors autograd saves for backward share one
allocation; counting tensors would count it several times. Why weak references: torch keeps a storage's
Python object alive exactly as long as the C++ storage (like it does for tensors), so a weakref callback on
it says when the memory is released. That may happen on another thread (CUDA's autograd worker) or in the
middle of our own bookkeeping, so the callback only queues the record; `drain()` does the arithmetic.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .budget import Budget
from .values import COMPONENTS


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind a tensor; wrapper subclasses (DTensor, float8) are looked through."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the hot path: skip the attribute probe
        return [t.untyped_storage()]
    if hasattr(t, "__tensor_flatten__"):
        inner_names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in inner_names)  # tensors (a placement may name its mesh too)
        return [st for value in inner if isinstance(value, torch.Tensor) for st in storages_of(value)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # sparse, nested and functional tensors have no storage
        return []


def tensors_in(values: Iterable[object]) -> Iterator[torch.Tensor]:
    """Tensors among op arguments or results: top level, or one level deep in lists and tuples."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


Move = tuple[int, str, str, int]
AllocationEvent = tuple[int, int]
"""(record serial, bytes): a storage counted with `bytes` (> 0), or its release (0); caching_allocator.Event."""


@dataclass
class AllocationLog:
    """Every storage counted and released since logging began, in the order the live count changed, and
    which of them were ever a parameter's gradient (a sharded plan reduce-scatters those instead)."""

    events: list[AllocationEvent] = field(default_factory=list)
    gradients: set[int] = field(default_factory=set)


"""(op clock when the storage was created, old component, new component, bytes)."""


class _Record:
    __slots__ = (
        "key",
        "ref",
        "nbytes",
        "origin",
        "component",
        "born",
        "moved",
        "retired",
        "serial",
        "uncounted",
    )

    def __init__(self, key: int, nbytes: int, origin: str, born: int, serial: int) -> None:
        self.key = key
        self.serial = serial
        self.ref: weakref.ref[torch.UntypedStorage] | None = None
        self.nbytes = nbytes
        self.origin = origin
        self.component = origin
        self.born = born
        self.moved = False
        self.retired = False
        self.uncounted = False  # made where nothing is counted (`uncounted`): 0 bytes until an op makes it


class StorageLedger:
    """Bytes of live storages on one device (and, with `host`, real CPU storages besides: `MemoryTracker`'s
    `host`), per component; optionally under a simulated budget."""

    def __init__(self, device: torch.device, budget: Budget | None = None, host: bool = False) -> None:
        self.device = device
        self.host = host
        self.budget = budget
        self.bytes: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
        self.live = 0
        self.clock = 0
        """Op counter, advanced by the tracker; records remember when they were created."""
        self.first_moves: list[Move] = []
        """Storages that left their origin for the first time (to be shown as such since creation)."""
        self._records: dict[int, _Record] = {}
        self._freed: list[_Record] = []
        self._by_identity: set[int] = set()
        self._serials = itertools.count()
        self.log: AllocationLog | None = None
        """When set: every storage counted and released from now on (`AllocationLog`)."""

    def observe(self, st: torch.UntypedStorage, origin: str, allocation: bool) -> _Record | None:
        """Count `st` if it is new, or (an `allocation`) if it grew by `resize_`; None when not counted here.

        `origin` is the component it falls back to when it is not a parameter, gradient or optimizer
        state. Only an `allocation` (an op's output) is checked against the budget: a storage that existed
        before tracking began (an op's input seen for the first time) is counted without failing.
        """
        nbytes = st.nbytes()
        rec = self._lookup(st)
        if rec is not None and rec.uncounted:
            if allocation:  # an op counted makes it (a view of it): it exists from here
                if self.budget is not None:
                    self.budget.check(self.live, nbytes, self.bytes)
                rec.uncounted, rec.nbytes, rec.origin, rec.component = False, nbytes, origin, origin
                self._add(rec.component, nbytes)
                if self.log is not None:
                    self.log.events.append((rec.serial, nbytes))
            return rec
        if rec is not None:
            if allocation and nbytes != rec.nbytes:
                if self.budget is not None and nbytes > rec.nbytes:
                    self.budget.check(self.live, nbytes - rec.nbytes, self.bytes)
                self._add(rec.component, nbytes - rec.nbytes)
                rec.nbytes = nbytes
                if self.log is not None:  # resize_: a new allocation in place of the old one
                    self.log.events.append((rec.serial, 0))
                    rec.serial = next(self._serials)
                    self.log.events.append((rec.serial, nbytes))
            return rec
        if nbytes == 0 or not self._on_device(st.device):
            return None
        if allocation and self.budget is not None:
            self.budget.check(self.live, nbytes, self.bytes)
        rec = _Record(id(st), nbytes, origin, self.clock, next(self._serials))
        if self.log is not None:
            self.log.events.append((rec.serial, nbytes))
        freed = self._freed
        rec.ref = weakref.ref(st, lambda _ref: freed.append(rec))
        self._records[rec.key] = rec
        self._add(origin, nbytes)
        return rec

    def uncounted(self, st: torch.UntypedStorage) -> None:
        """`st` was made where nothing is counted (`tracker.uncounted`): an op reading it does not count it
        either; one making it (a view of it, counted) does, from then on."""
        if self._lookup(st) is not None or not self._on_device(st.device):
            return
        rec = _Record(id(st), 0, "other", self.clock, next(self._serials))
        rec.uncounted = True
        freed = self._freed
        rec.ref = weakref.ref(st, lambda _ref: freed.append(rec))
        self._records[rec.key] = rec

    def resized(self, st: torch.UntypedStorage) -> None:
        """`st` was resized in place (FSDP2 frees a gathered layer so, and grows it back: `storage_resize`):
        a counted storage shrunk to 0 bytes is released; grown, it is counted again as a new allocation."""
        rec = self._lookup(st)
        if rec is None:
            return
        nbytes = st.nbytes()
        if nbytes == 0 and rec.nbytes:
            self._add(rec.component, -rec.nbytes)
            rec.nbytes = 0
            if self.log is not None:
                self.log.events.append((rec.serial, 0))
        elif nbytes and not rec.nbytes:
            if self.budget is not None:
                self.budget.check(self.live, nbytes, self.bytes)
            rec.nbytes, rec.serial = nbytes, next(self._serials)
            self._add(rec.component, nbytes)
            if self.log is not None:
                self.log.events.append((rec.serial, nbytes))
        else:
            self.observe(st, rec.component, allocation=True)

    def assign(self, tensors: Iterable[torch.Tensor], component: str) -> None:
        """The storages of `tensors` now belong to `component` (e.g. a parameter's fresh `.grad`)."""
        for t in tensors:
            for st in storages_of(t):
                rec = self.observe(st, "other", allocation=False)
                if rec is not None:
                    self._move(rec, component)
                    self._by_identity.add(rec.key)

    def classify(self, groups: Iterable[tuple[str, Iterable[torch.Tensor]]]) -> None:
        """Re-derive identity components from scratch; earlier groups win when a storage is in several.

        Storages that are no longer a parameter, gradient or optimizer state fall back to their origin.
        """
        previous, self._by_identity = self._by_identity, set()
        claimed: set[int] = set()
        for component, tensors in groups:
            fresh = [t for t in tensors if not any(id(st) in claimed for st in storages_of(t))]
            self.assign(fresh, component)
            claimed |= self._by_identity
        for key in previous - self._by_identity:
            rec = self._records.get(key)
            if rec is not None:
                self._move(rec, rec.origin)

    def drain(self) -> None:
        """Apply the frees the weakref callbacks queued, oldest storage first: storages that die together
        (a container's tensors) call back in an order that follows their addresses, which differs from run
        to run, and the allocator model's reserved bytes depend on the order of the frees it replays."""
        while self._freed:
            batch = sorted(self._freed, key=lambda rec: rec.serial)
            self._freed.clear()
            for rec in batch:
                self._retire(rec)

    def _lookup(self, st: torch.UntypedStorage) -> _Record | None:
        rec = self._records.get(id(st))
        if rec is None or rec.ref is None:
            return None
        if rec.ref() is st:
            return rec
        self._retire(rec)  # its storage died and a new one reused the id before the free was drained
        return None

    def _on_device(self, device: torch.device) -> bool:
        # device equality first: `.type` builds a string, which costs more than the rest of observe()
        return (
            device == self.device
            or (self.device.index is None and device.type == self.device.type)
            or (self.host and device.type == "cpu")
        )

    def _move(self, rec: _Record, component: str) -> None:
        if component == "gradients" and self.log is not None:
            self.log.gradients.add(rec.serial)
        if rec.component != component:
            if not rec.moved:
                self.first_moves.append((rec.born, rec.component, component, rec.nbytes))
                rec.moved = True
            self.bytes[rec.component] -= rec.nbytes
            self.bytes[component] += rec.nbytes
            rec.component = component

    def _add(self, component: str, nbytes: int) -> None:
        self.bytes[component] += nbytes
        self.live += nbytes

    def _retire(self, rec: _Record) -> None:
        if rec.retired:
            return
        rec.retired = True
        self._add(rec.component, -rec.nbytes)
        if self.log is not None and not rec.uncounted:
            self.log.events.append((rec.serial, 0))
        if self._records.get(rec.key) is rec:
            del self._records[rec.key]
        self._by_identity.discard(rec.key)
