"""The memory of a plan that steps the optimizer in backward (`strategies.optimizer_step: in_backward`).

Why a transformation of the standard prediction: such a step differs from a standard one only in its
gradients and its optimizer phase, both of which are arithmetic. Each gradient is stepped and freed as soon
as backward accumulates it, so gradients never pile up: at any moment of backward at most one parameter's
gradient is alive, with the temporaries of its step (the optimizer-state strategy's per-tensor fp32
temporaries over the tensor or its step's chunk, its fused ones, or its foreach ones over that one tensor on
CUDA; a per-parameter optimizer carries nothing
into the next tensor's step). And no optimizer phase follows backward. So the walk reads the standard
traces without their gradients, with one step of the largest parameter (its gradient and temporaries) in
each backward segment that makes gradients, where the trace says it can fall (`_transform`); the levels
keep no gradients and no optimizer-phase bytes. The traces themselves stay those of the standard step (one trace serves both).
"""

from __future__ import annotations

import dataclasses

import torch

from memtrain.memory.footprint import COMPONENTS, ModelShape
from memtrain.planner.activations import FittedTrace, Segment, Vec
from memtrain.planner.memory_model import StateLevels, Traces
from memtrain.strategies.optimizer import BNB_MIN_8BIT_SIZE, BNB_QMAP_BYTES, EightBitStates, OptimizerStates
from memtrain.strategies.precision import Precision

GRADIENTS, OTHER = COMPONENTS.index("gradients"), COMPONENTS.index("other")


def in_flight(
    shape: ModelShape, precision: Precision, optimizer_states: OptimizerStates, foreach: bool
) -> Vec:
    """The most one parameter's step adds in backward: its gradient and its step's temporaries."""
    largest = max((p.numel for p in shape.trainable.params), default=0)
    element = torch.empty((), dtype=precision.stored_dtype).element_size()
    temporaries = 4 * optimizer_states.per_tensor_temporaries * optimizer_states.step_elements(largest)
    if optimizer_states.fused_temporaries is not None:
        temporaries = 4 * optimizer_states.fused_temporaries * largest
    elif foreach and optimizer_states.foreach_temporaries is not None:
        temporaries = 4 * optimizer_states.foreach_temporaries * largest
    vec = [0.0] * len(COMPONENTS)
    vec[GRADIENTS] = float(element * largest)
    vec[OTHER] = float(temporaries)
    return tuple(vec)


def levels(standard: StateLevels, shape: ModelShape, optimizer_states: OptimizerStates) -> StateLevels:
    """`standard`'s levels with no gradients kept and no optimizer phase (it then never peaks), and the
    8-bit states' quantisation maps once per per-parameter optimizer instead of once."""
    states = standard.optimizer_states + extra_state_bytes(shape, optimizer_states)
    weights, _, _ = standard.stored
    return dataclasses.replace(
        standard,
        optimizer_states=states,
        gradients=0,
        optimizer_gradients=0,
        optimizer_extra=0,
        stored=(weights, 0, states),
    )


def extra_state_bytes(shape: ModelShape, optimizer_states: OptimizerStates) -> int:
    """States a per-parameter optimizer holds beyond one optimizer over all parameters."""
    if not isinstance(optimizer_states, EightBitStates):
        return 0
    quantised = sum(1 for p in shape.trainable.params if p.numel >= BNB_MIN_8BIT_SIZE)
    return max(quantised - 1, 0) * BNB_QMAP_BYTES


def traces(standard: Traces, added: Vec, tokens: int) -> Traces:
    """The standard traces at `tokens` (a fit of that one size) with the gradients stepped as they come."""
    return {mode: _transform(trace, added, tokens) for mode, trace in standard.items()}


def _transform(trace: FittedTrace, added: Vec, tokens: int) -> FittedTrace:
    """Each segment without its gradients; a backward segment that makes gradients gets one step (`added`:
    the largest gradient and its step's temporaries).

    Where the step falls within the segment is not traced, so its moment is estimated. A segment whose
    traced peak already held gradients (a block: weights' gradients come as its backward goes) steps there:
    the peak without its gradients plus one step (of the traced peak's gradients one is alive). A segment
    whose traced peak came before its first gradient (the head: the logits' gradient is freed before the
    head's weight gradient exists) steps after that peak: at its end level plus one step, never above the
    bound the trace proves (the traced peak held at least the stepping gradient, so only the temporaries
    can come on top of it). This end level misses what the segment frees after the step (the final norm's
    activations, under 1% of the peak in the tests)."""
    zero = (0.0,) * len(COMPONENTS)
    fitted, flat = {}, {}
    for key in trace.intercept:
        seg = trace.at(key, tokens)
        at_peak, maxima, end = (_no_gradients(v) for v in (seg.at_peak, seg.maxima, seg.end))
        if key.phase.startswith("bwd") and max(seg.maxima[GRADIENTS], seg.end[GRADIENTS]) > 0:
            made = seg.at_peak[GRADIENTS]
            if made > 0:
                step = tuple(min(made, x) if i == GRADIENTS else x for i, x in enumerate(added))
                at_peak = _plus(at_peak, step)
            else:
                bound = _plus(at_peak, _no_gradients(added))
                at_peak = max(at_peak, min(_plus(end, added), bound, key=sum), key=sum)
            maxima = _plus(maxima, added)
        fitted[key] = Segment(at_peak, maxima, end)
        flat[key] = Segment(zero, zero, zero)
    return dataclasses.replace(trace, intercept=fitted, slope=flat)


def _no_gradients(v: Vec) -> Vec:
    return tuple(0.0 if i == GRADIENTS else x for i, x in enumerate(v))


def _plus(a: Vec, b: Vec) -> Vec:
    return tuple(x + y for x, y in zip(a, b, strict=True))
