"""A clipped step with the optimizer step in backward: forward and backward twice, the norm first.

Why: `strategies.optimizer_step: in_backward` steps each parameter as soon as backward has its gradient,
but `train.grad_clip` scales every gradient by `min(1, clip / norm)` of the global norm, which is known only
once backward has made every gradient. As LOMO and AdaLomo do, the step runs twice: a first pass whose hooks
only take each gradient's norm and free it (no gradient is kept), then, once the global norm is known, a
second pass that steps each parameter with its gradient scaled by `clip_grad_norm_`'s factor. Both passes
see the same batch and the same random numbers (the second replays the first's RNG streams: dropout draws
the same masks), so they make the same gradients and the update is the standard step's with the same clip.
A non-finite norm is known before any parameter moves: the second pass is not run and the step is skipped,
as a standard step is. The memory is that of one in-backward pass (the first holds less); the compute of
one more forward and backward is the step-time model's (`OptimizerStep.passes`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from memtrain.checkpoint import rng_state, set_rng_state
from memtrain.recipe import Recipe
from memtrain.strategies.optimizer_step import InBackwardOptimizer
from memtrain.training.results import StepTotals


class Accumulating(Protocol):
    """What the two passes read of the trainer (`memtrain.training.trainer.Trainer`, which imports this
    module: a protocol, not an import)."""

    recipe: Recipe
    optimizer: torch.optim.Optimizer | None

    def accumulate_gradients(self, step: int) -> StepTotals: ...


def accumulate(trainer: Accumulating, step: int) -> StepTotals:
    """`trainer.accumulate_gradients(step)`, run as a norm pass and an update pass when the optimizer
    steps in backward and `train.grad_clip` is set; the totals are the update pass's (the norm pass's
    when the norm is not finite and nothing steps)."""
    optimizer, clip = trainer.optimizer, trainer.recipe.train.grad_clip
    if not isinstance(optimizer, InBackwardOptimizer) or clip is None:
        return trainer.accumulate_gradients(step)
    streams = rng_state()
    optimizer.begin_norm_pass()
    measured = trainer.accumulate_gradients(step)
    if not measured.global_tokens:  # nothing to learn: the trainer skips the step
        optimizer.finish_step()
        return measured
    if not optimizer.begin_update_pass(clip):  # a non-finite norm: skipped before anything stepped
        return measured
    set_rng_state(streams)
    return trainer.accumulate_gradients(step)
