"""Learning-rate schedules by name (`train.schedule`): each one a pure function of the step.

Why a registry: a schedule is one formula, so a new one is a function plus one line,
`SCHEDULES.register(Schedule("mine", my_lr))`, and the recipe accepts the name, lists it in its JSON schema
and the trainer uses it. Being stateless, a schedule needs nothing in a checkpoint but the step.

Why here, below the recipe: the recipe validates `train.schedule` against these names as it validates
every other key (one pass, one line per mistake, the names in `memtrain schema`), so this module must
not import the recipe. A schedule reads its settings through `ScheduleSettings`, which the recipe's
`train:` section satisfies as it is.

Built in, each after a linear warmup over `train.warmup_steps` to `train.lr`:
- `cosine` (the default): cosine decay to `min_lr_ratio * lr` at `train.steps`;
- `linear`: linear decay to `min_lr_ratio * lr` at `train.steps`;
- `constant`: `lr` from the end of the warmup on;
- `wsd` (warmup-stable-decay): `lr` until the last `decay_fraction` of `train.steps`, then a
  `decay_shape` decay (linear, cosine or 1-sqrt) to `min_lr_ratio * lr` at `train.steps`. Why: a run can
  be extended or branched from any point of its stable phase, and only the short decay is redone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from memtrain.registry import Registry

DecayShape = Literal["linear", "cosine", "1-sqrt"]
"""How `wsd` ends (`train.decay_shape`); each has its formula in `DECAY_SHAPES`."""


class ScheduleSettings(Protocol):
    """What a schedule reads (the recipe's `train:` section has these)."""

    @property
    def schedule(self) -> str: ...

    @property
    def lr(self) -> float: ...

    @property
    def steps(self) -> int: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def min_lr_ratio(self) -> float: ...

    @property
    def decay_fraction(self) -> float: ...

    @property
    def decay_shape(self) -> DecayShape: ...


LrFunction = Callable[[int, ScheduleSettings], float]
"""(0-based optimizer step, settings) -> the learning rate of that step."""


@dataclass(frozen=True)
class Schedule:
    name: str
    lr: LrFunction


SCHEDULES: Registry[Schedule] = Registry("train.schedule")


def lr_at(step: int, settings: ScheduleSettings) -> float:
    """The learning rate of the optimizer step with 0-based index `step` under `settings.schedule`."""
    return SCHEDULES.get(settings.schedule).lr(step, settings)


def due(step: int, every: int) -> bool:
    """Whether an every-`every`-steps event (a checkpoint, an evaluation) falls after step `step` (0: never)."""
    return every > 0 and (step + 1) % every == 0


def after_warmup(factor: Callable[[float, float], float]) -> LrFunction:
    """Linear warmup, then `lr * factor(progress, min_lr_ratio)` with progress going from 0 (the end of
    the warmup) to 1 (`train.steps`) and staying at 1 after it."""

    def lr(step: int, s: ScheduleSettings) -> float:
        if s.warmup_steps and step < s.warmup_steps:
            return s.lr * (step + 1) / s.warmup_steps
        decay_steps = max(s.steps - s.warmup_steps, 1)
        progress = min((step - s.warmup_steps) / decay_steps, 1.0)
        return s.lr * factor(progress, s.min_lr_ratio)

    return lr


def _cosine(progress: float, floor: float) -> float:
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * cosine


def _linear(progress: float, floor: float) -> float:
    return floor + (1.0 - floor) * (1.0 - progress)


def _constant(progress: float, floor: float) -> float:
    return 1.0


def _one_minus_sqrt(progress: float, floor: float) -> float:
    return floor + (1.0 - floor) * (1.0 - math.sqrt(progress))


DECAY_SHAPES: dict[DecayShape, Callable[[float, float], float]] = {
    "linear": _linear,
    "cosine": _cosine,
    "1-sqrt": _one_minus_sqrt,
}


def decay_steps(s: ScheduleSettings) -> int:
    """The steps of `wsd`'s decay: `decay_fraction` of `train.steps` (rounded, at least 1), never more
    than the steps after the warmup."""
    return max(min(round(s.decay_fraction * s.steps), s.steps - s.warmup_steps), 1)


def _wsd(step: int, s: ScheduleSettings) -> float:
    """Linear warmup, `lr` while stable, then `decay_shape` from `lr` (at `steps - decay_steps`) to
    `min_lr_ratio * lr` (at `steps`, and after it)."""
    if s.warmup_steps and step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    decay = decay_steps(s)
    progress = min(max(step - (s.steps - decay), 0) / decay, 1.0)
    return s.lr * DECAY_SHAPES[s.decay_shape](progress, s.min_lr_ratio)


SCHEDULES.register(Schedule("cosine", after_warmup(_cosine)))
SCHEDULES.register(Schedule("linear", after_warmup(_linear)))
SCHEDULES.register(Schedule("constant", after_warmup(_constant)))
SCHEDULES.register(Schedule("wsd", _wsd))
