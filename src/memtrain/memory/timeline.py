"""A bounded time series of live bytes per component, for the timeline plots.

A real step runs tens of thousands of ops; plotting every one is neither cheap nor readable. Each step keeps
at most `2 * samples_per_step` samples: when full, neighbours are merged keeping the larger total, so the
peak always survives. The first step (the anomalous one) and the latest `max_steps - 1` steps are kept.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .values import COMPONENTS


class Sample(NamedTuple):
    """Live bytes after op number `t`; `bytes` follows COMPONENTS order. (A tuple: one is made per op.)"""

    t: int
    step: int
    phase: str
    bytes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.bytes)


@dataclass(frozen=True)
class Boundary:
    """Op number `t` starts `phase` (or, with phase "step", starts step `step`)."""

    t: int
    step: int
    phase: str


@dataclass
class _StepSeries:
    step: int
    samples: list[Sample] = field(default_factory=list)
    boundaries: list[Boundary] = field(default_factory=list)
    stride: int = 1
    pending: Sample | None = None
    pending_count: int = 0


class Timeline:
    """Samples and phase boundaries of the recent steps, downsampled so that peaks survive."""

    def __init__(self, samples_per_step: int = 2000, max_steps: int = 8) -> None:
        if samples_per_step < 1 or max_steps < 1:
            raise ValueError("samples_per_step and max_steps must be >= 1")
        self.samples_per_step = samples_per_step
        self.max_steps = max_steps
        self._steps: list[_StepSeries] = []

    def begin_step(self, t: int, step: int) -> None:
        self._flush()
        self._steps.append(_StepSeries(step, boundaries=[Boundary(t, step, "step")]))
        if len(self._steps) > self.max_steps:
            del self._steps[1]

    def mark_phase(self, t: int, phase: str) -> None:
        """Phase `phase` starts after op `t`; a phase left without any op in it is forgotten."""
        if not self._steps:
            return
        boundaries = self._steps[-1].boundaries
        if boundaries[-1].t == t and boundaries[-1].phase != "step":
            boundaries.pop()
        boundaries.append(Boundary(t, self._steps[-1].step, phase))

    def add(
        self, t: int, phase: str, component_bytes: dict[str, int], total: int, keep: bool = False
    ) -> None:
        """Record live bytes after op `t`; `total` is their sum (the caller already has it).

        `keep` bypasses downsampling, so that phase boundaries and step ends are drawn exactly.
        """
        if not self._steps:
            return
        series = self._steps[-1]
        if keep:
            self._flush()
        if keep or series.pending is None or total > series.pending.total:
            series.pending = Sample(t, series.step, phase, tuple(component_bytes[c] for c in COMPONENTS))
        series.pending_count += 1
        if keep or series.pending_count >= series.stride:
            self._flush()
        if len(series.samples) >= 2 * self.samples_per_step:
            # pairs keep the higher sample; a `keep` add can flush two samples at once, so the count may
            # be odd: the unpaired last sample stays as it is
            samples = series.samples
            pairs = zip(samples[0:-1:2], samples[1::2], strict=True)
            halved = [a if a.total >= b.total else b for a, b in pairs]
            series.samples = halved + samples[len(halved) * 2 :]
            series.stride *= 2

    def reclassify(self, moves: Sequence[tuple[int, str, str, int]]) -> None:
        """Redraw bytes recognised late (e.g. optimizer state) as their new component since creation.

        Each move is (op clock at creation, old component, new component, bytes); one sweep over the samples.
        """
        ordered = sorted(moves)
        delta = [0] * len(COMPONENTS)
        i = 0
        for series in self._steps:
            if series.pending is not None:
                series.samples.append(series.pending)
            start = bisect.bisect_right(series.samples, ordered[0][0], key=lambda s: s.t)
            for k in range(start, len(series.samples)):
                s = series.samples[k]
                while i < len(ordered) and ordered[i][0] < s.t:
                    _, old, new, n = ordered[i]
                    delta[COMPONENTS.index(old)] -= n
                    delta[COMPONENTS.index(new)] += n
                    i += 1
                series.samples[k] = Sample(
                    s.t, s.step, s.phase, tuple(map(sum, zip(s.bytes, delta, strict=True)))
                )
            if series.pending is not None:
                series.pending = series.samples.pop()

    def _flush(self) -> None:
        series = self._steps[-1] if self._steps else None
        if series is not None and series.pending is not None:
            series.samples.append(series.pending)
            series.pending, series.pending_count = None, 0

    @property
    def samples(self) -> Sequence[Sample]:
        self._flush()
        return [s for series in self._steps for s in series.samples]

    @property
    def boundaries(self) -> Sequence[Boundary]:
        return [b for series in self._steps for b in series.boundaries]
