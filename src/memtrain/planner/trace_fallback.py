"""When the fake-tensor trace cannot run a model: the same trace of the same small clone on real tensors.

Why: the planner's trace runs the training step under fake tensors, where every op runs its meta kernel.
Some ops have none, or one stricter than the CPU kernel (torch's `_grouped_mm` meta kernel accepts only
bf16, while the CPU kernel trains fp32: grouped_mm_trace.py gives the trace an exact stand-in, so
mixture-of-experts models no longer land here; a model's own custom op might). The trace only counts storages,
and the memory tracker counts real storages exactly as it counts fake ones (a `memory.track` run is that
measurement), so the same trace on real CPU tensors gives the numbers the fake one would have: correct by
construction, only slower and using real memory. It is therefore bounded: the clone's traced step is
estimated first, and above `REAL_TRACE_LIMIT` the planner stops with `Unsupported` naming the model, the
cause and what to do instead of tracing a large model for real.

The estimate is deliberately generous (it only has to stop a trace that would not fit or would take
minutes): fp32 weights and gradients of the clone, plus per token a few dozen hidden-width activations per
block and the logits three times over (fp32 logits, their gradient, the loss's softmax).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memtrain.errors import MemtrainError, Unsupported
from memtrain.memory.footprint import ModelShape
from memtrain.planner import activations
from memtrain.planner.activations import FittedTrace

REAL_TRACE_LIMIT = 2 * 2**30  # bytes the estimated real trace may use (a 3-block clone of a ~1B model)
ACTIVATIONS_PER_BLOCK = 48  # hidden-width fp32 tensors per token a block keeps or holds at once, at most


def clone_step_bytes(shape: ModelShape, depth: int, tokens: int, hidden: int, head_numel: int) -> int:
    """A generous estimate of what one traced step of the `depth`-block clone holds at `tokens` tokens."""
    blocks = sum(p.numel for p in shape.params if p.block is not None)
    rest = shape.numel - blocks
    clone_numel = rest + blocks * depth // max(shape.num_blocks, 1)
    vocab = head_numel // hidden if hidden else 0
    per_token = 4 * (ACTIVATIONS_PER_BLOCK * hidden * depth + 3 * vocab)
    return 2 * 4 * clone_numel + tokens * per_token


def trace_for_real(
    name: str,
    cause: str,
    estimated_bytes: int,
    traced: Callable[[], FittedTrace],
    progress: Callable[[str], None],
) -> FittedTrace:
    """`traced()` (the fake-tensor trace that failed with `cause`) rerun on real CPU tensors, when its
    estimated size is within the bound; `Unsupported` naming the model and the cause otherwise."""
    if estimated_bytes > REAL_TRACE_LIMIT:
        raise Unsupported(
            f"{name} cannot be traced: {cause}; tracing its clone with real tensors instead would need about "
            f"{estimated_bytes / 2**30:.1f} GiB (the bound is {REAL_TRACE_LIMIT / 2**30:.0f} GiB): pin every "
            "strategy (strategies.* and batch.micro_size) to train without the planner, or plan a smaller "
            "config of the same family (fewer layers or a shorter data.seq_len) and scale"
        )
    progress(f"{name}: the fake-tensor trace failed ({cause}); tracing the clone with real tensors")
    try:
        with _real_tensors():
            return traced()
    except MemtrainError:
        raise
    except Exception as exc:
        raise Unsupported(
            f"{name} cannot be traced: {cause}; nor with real tensors: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc


class _RealTensors:
    """Stands in for the fake-tensor mode: entering it changes nothing, and a batch is used as it is."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def from_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@contextlib.contextmanager
def _real_tensors() -> Iterator[None]:
    """`activations.trace_step` with real tensors: its mode factory swapped for `_RealTensors` meanwhile
    (the trace itself, hooks and tracker included, is unchanged)."""
    factory: Any = activations.fake_tensors
    activations.fake_tensors = _RealTensors  # type: ignore[assignment]
    try:
        yield
    finally:
        activations.fake_tensors = factory
