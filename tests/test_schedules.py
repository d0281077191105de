"""Learning-rate schedules: each built-in one is its closed form (cosine exactly the formula it has always
been), and every one is a function of the step alone. `wsd` (warmup-stable-decay) did not exist: its tests
failed with "train.schedule: unknown" before it was registered."""

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


def _train(
    schedule: str, lr: float, steps: int, warmup: int, floor: float, **wsd: float | str
) -> TrainConfig:
    return TrainConfig.model_validate(
        {"schedule": schedule, "lr": lr, "steps": steps, "warmup_steps": warmup, "min_lr_ratio": floor, **wsd}
    )


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


# lr 2.0, 10 steps, 2 of warmup, floor 0.1 (0.2 absolute); wsd decays over 0.2 * 10 = 2 steps (8 and 9).
# Each value by hand from the closed form, at the named steps: first, the warmup's edge, the decay's start,
# the middle, the last trained step (9), train.steps and after it.
STEPS_TO_CHECK = (0, 1, 2, 6, 7, 8, 9, 10, 14)
_COS_7_8 = 0.2 + 1.8 * 0.5 * (1 + math.cos(7 * math.pi / 8))  # cosine at progress 7/8
CLOSED_FORMS = {
    "cosine": (
        1.0,
        2.0,
        2.0,
        1.1,
        0.2 + 1.8 * 0.5 * (1 + math.cos(5 * math.pi / 8)),
        0.2 + 1.8 * 0.5 * (1 + math.cos(6 * math.pi / 8)),
        _COS_7_8,
        0.2,
        0.2,
    ),
    "linear": (1.0, 2.0, 2.0, 1.1, 0.2 + 1.8 * 3 / 8, 0.2 + 1.8 * 2 / 8, 0.2 + 1.8 / 8, 0.2, 0.2),
    "constant": (1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0),
    "wsd-linear": (1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.1, 0.2, 0.2),
    "wsd-cosine": (1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.1, 0.2, 0.2),
    "wsd-1-sqrt": (1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.2 + 1.8 * (1 - math.sqrt(0.5)), 0.2, 0.2),
}


def _named(name: str) -> TrainConfig:
    schedule, _, shape = name.partition("-")
    wsd = {"decay_fraction": 0.2, "decay_shape": shape} if shape else {}
    return _train(schedule, 2.0, 10, 2, 0.1, **wsd)


@pytest.mark.parametrize("name", sorted(CLOSED_FORMS))
def test_every_schedule_at_its_edges_is_its_closed_form(name: str) -> None:
    """Warmup edge, middle, end and after the end, against values worked out by hand; cosine and linear
    end at min_lr_ratio * lr (a cosine with a minimum)."""
    train = _named(name)
    for step, expected in zip(STEPS_TO_CHECK, CLOSED_FORMS[name], strict=True):
        assert lr_at(step, train) == pytest.approx(expected, rel=1e-12), (name, step)


def _wsd_closed_form(step: int, lr: float, steps: int, warmup: int, floor: float, fraction: float) -> float:
    """Warmup, stable at lr, then a straight line over the last round(fraction * steps) steps to floor * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay = max(min(round(fraction * steps), steps - warmup), 1)
    start = steps - decay
    return lr if step < start else lr * (1 - (1 - floor) * min((step - start) / decay, 1.0))


@pytest.mark.parametrize(("lr", "steps", "warmup", "floor"), SETTINGS)
@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
def test_wsd_is_stable_then_decays_over_its_fraction(
    lr: float, steps: int, warmup: int, floor: float, fraction: float
) -> None:
    train = _train("wsd", lr, steps, warmup, floor, decay_fraction=fraction)
    for step in range(steps + 3):
        expected = _wsd_closed_form(step, lr, steps, warmup, floor, fraction)
        assert lr_at(step, train) == pytest.approx(expected, rel=1e-12), step
    assert lr_at(steps, train) == pytest.approx(lr * floor, rel=1e-12)


def test_wsd_settings_are_checked_by_the_recipe() -> None:
    """A decay fraction of 0 or an unknown decay shape is one line naming its key."""
    from memtrain.errors import RecipeError
    from memtrain.recipe import Recipe

    with pytest.raises(RecipeError) as caught:
        Recipe.from_dict({"train": {"schedule": "wsd", "decay_fraction": 0, "decay_shape": "sqrt"}})
    problems = caught.value.problems
    assert any(p.startswith("train.decay_fraction:") for p in problems), problems
    assert any(p.startswith("train.decay_shape:") and "1-sqrt" in p for p in problems), problems
