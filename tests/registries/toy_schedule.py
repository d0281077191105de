"""A toy learning-rate schedule, written as a user would add one: this file and one registry line
(`SCHEDULES.register(Schedule("halving", halving))`).

`halving` starts at `train.lr` and halves it every optimizer step (no warmup, no floor).
"""

from __future__ import annotations

from memtrain.schedules import ScheduleSettings


def halving(step: int, settings: ScheduleSettings) -> float:
    return settings.lr * 0.5**step
