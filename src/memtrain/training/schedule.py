"""Learning-rate schedule as a pure function of the step: linear warmup, then cosine decay to
`min_lr_ratio * lr`. Being stateless, it needs nothing in a checkpoint but the step."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR for the optimizer step with 0-based index `step`."""
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
