"""Learning-rate schedules: each built-in one is its closed form (cosine exactly the formula it has always
been), and every one is a function of the step alone."""

from __future__ import annotations

import math

import pytest

from memtrain.recipe import TrainConfig
from memtrain.schedules import SCHEDULES, lr_at

SETTINGS = [  # (lr, steps, warmup_steps, min_lr_ratio)
    (3e-4, 100, 0, 0.1),
    (1e-2, 10, 3, 0.0),
    (5e-3, 7, 7, 0.5),
    (1e-3, 1, 0, 1.0),
]


def _train(schedule: str, lr: float, steps: int, warmup: int, floor: float) -> TrainConfig:
    return TrainConfig(schedule=schedule, lr=lr, steps=steps, warmup_steps=warmup, min_lr_ratio=floor)


def _cosine_before(step: int, lr: float, total: int, warmup: int, floor: float) -> float:
    """The schedule as it was before schedules had names (`train.schedule` did not exist)."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (floor + (1.0 - floor) * cosine)


def _after_warmup(step: int, steps: int, warmup: int) -> float | None:
    """Progress from the end of the warmup (0) to train.steps (1), or None inside the warmup."""
    return None if step < warmup else min((step - warmup) / max(steps - warmup, 1), 1.0)


@pytest.mark.parametrize(("lr", "steps", "warmup", "floor"), SETTINGS)
def test_cosine_is_the_schedule_it_always_was(lr: float, steps: int, warmup: int, floor: float) -> None:
    train = _train("cosine", lr, steps, warmup, floor)
    for step in range(steps + 3):
        assert lr_at(step, train) == _cosine_before(step, lr, steps, warmup, floor), step


@pytest.mark.parametrize(("lr", "steps", "warmup", "floor"), SETTINGS)
def test_linear_decays_in_a_straight_line_to_the_floor(
    lr: float, steps: int, warmup: int, floor: float
) -> None:
    train = _train("linear", lr, steps, warmup, floor)
    for step in range(steps + 3):
        progress = _after_warmup(step, steps, warmup)
        expected = lr * (step + 1) / warmup if progress is None else lr - (lr - floor * lr) * progress
        assert lr_at(step, train) == pytest.approx(expected, rel=1e-12), step


@pytest.mark.parametrize(("lr", "steps", "warmup", "floor"), SETTINGS)
def test_constant_holds_lr_after_the_warmup(lr: float, steps: int, warmup: int, floor: float) -> None:
    train = _train("constant", lr, steps, warmup, floor)
    for step in range(steps + 3):
        expected = lr * (step + 1) / warmup if step < warmup else lr
        assert lr_at(step, train) == expected, step


def test_every_schedule_is_a_function_of_the_step() -> None:
    for name in SCHEDULES.names():
        train = _train(name, 1e-3, 20, 4, 0.1)
        forward = [lr_at(step, train) for step in range(20)]
        assert [lr_at(step, train) for step in reversed(range(20))] == forward[::-1], name
