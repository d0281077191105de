"""The activation side of the memory model: trace a few blocks of the real model, fit, and scale.

Why a trace: activations depend on the attention kernel, the MLP shape, dropout, the loss's fp32 logits and
on how each block's Python code holds its intermediates; formulas get all of these wrong somewhere. So the
planner runs the training step itself — forward and backward of two micro-steps, built and run the way the
trainer builds and runs them (`apply_strategies`, autocast, the trainer's own loss) — under `fake_tensors()` with the `MemoryTracker` counting every storage. No memory is used, so
any size traces in well under a second on a CPU.

Why segments: the peak of a step is not a sum of independent maxima. Activations grow block by block in
forward while gradients are still absent (first micro-step), then shrink block by block in backward while
gradients appear; a later micro-step runs with all gradients present. The trace is therefore cut at block
boundaries (forward hooks on the blocks; tensor hooks on the blocks' outputs and on the first block's input
mark where each block's backward starts and ends) into segments, and every segment keeps, per component,
its level at the start, at its own peak, its component maxima and its end. `memory_model.walk` replays
those relative changes over the full depth of the real model, block by block, with each block's
checkpointing mode, from the model-state levels given by arithmetic.

Why a reduced depth: a clone of three blocks — the first (it receives the embeddings), a middle one and
the last (its output goes to the head) — has every kind of segment. The middle block is the one that
stands for the others: only a block with a block on either side frees its predecessor's output inside its
own segment, as every middle block of the real model does (measured: two blocks are 1% off for bf16
weights). Embeddings, the head and the loss keep their real sizes (vocabulary and width are unchanged),
so the head side needs no scaling; each middle block of the real model is one more copy of the clone's.
Models with at most three blocks are traced whole, and so are models the clone cannot stand for (blocks
of different structures or kinds, blocks run more than once per forward: model_probe.py checks both).

One segment is not a block's: `fwd.release`, the end of autocast. Autocast caches the low-precision copy
of every weight it casts until its context exits; copies that autograd saved live on, the others (those
of recomputed blocks) are freed there, all at once. The walk charges that release to each block by its
mode, one clone's share per block.

Why each checkpointing mode is traced rather than derived from a `none` profile with
`Checkpointing.estimate`: measured on GPT-2, Llama, Qwen2 and Phi (fp32, full / selective / fraction 0.5),
both give the activations' peak to the byte, but the walk needs more than that peak: each mode's backward
segments (the recompute's transients, the gradients of activations in `other`), which only a trace of
that mode has. A trace costs about a second.

Why two micro-batch sizes: at a fixed sequence length every activation is proportional to the micro-batch,
so each number is fitted as a + b·tokens from two traces and read at any micro-batch size
(model_probe.py picks the two sizes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain.memory import MemoryTracker, StepMemory, fake_tensors
from memtrain.memory.footprint import COMPONENTS
from memtrain.memory.ledger import AllocationLog
from memtrain.memory.modules import graph_tensors, is_compiled
from memtrain.planner.allocation_trace import AllocationFit, PieceKey, Pieces, fit_allocations
from memtrain.planner.attention_kernels import Capability, traced_attention
from memtrain.planner.compiled_trace import traced_as_compiled
from memtrain.planner.cuda_dropout import traced_dropout
from memtrain.planner.grouped_mm_trace import traced_grouped_mm
from memtrain.planner.spec import loss_output
from memtrain.strategies.adapters import Adapters
from memtrain.strategies.apply import apply_strategies
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.compile import Compile
from memtrain.strategies.loss import Loss
from memtrain.strategies.precision import Precision
from memtrain.strategies.quantization import Quantization

Vec = tuple[float, ...]
"""Bytes per component, in `COMPONENTS` order."""
ParamKey = tuple[int, str]
"""A parameter as (its block's index, its name inside the block), (-1, its full name) outside the blocks:
the same for a clone's block and every real block it stands for."""

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, Any]]
MICRO_STEPS = ("first", "later")  # without gradients at the start / with every gradient present
CLONE_DEPTH = 3  # first, middle, last
_WHOLE = {"fwd.block": "fwd.pre", "bwd.block": "bwd.head"}  # a trace without block segments: what holds them


@dataclass(frozen=True)
class SegmentKey:
    micro_step: str  # "first" or "later"
    phase: str  # fwd.pre, fwd.block, fwd.head, fwd.release, bwd.head, bwd.block, bwd.pre
    block: int = -1  # the clone's block index for *.block segments


@dataclass(frozen=True)
class Segment:
    """One stretch of a traced micro-step, relative to its start: where it peaked (per component, at the
    moment of its total peak), how high each component got, and where it ended."""

    at_peak: Vec
    maxima: Vec
    end: Vec


@dataclass(frozen=True)
class StepTrace:
    """The segments of two traced micro-steps of one model at one micro-batch size."""

    tokens: int
    depth: int
    segments: dict[SegmentKey, Segment]
    attention: str = ""  # which attention the trace ran (`KernelLog.describe`)
    reentered: bool = False  # a block ran twice in a micro-step: its segments are unreliable
    no_grad: frozenset[ParamKey] = frozenset()  # trainable parameters left without a gradient
    allocations: Pieces = ()  # every storage made and freed, in order (allocation_trace.py)
    gradient_allocations: frozenset[int] = frozenset()  # which of them were gradients


@dataclass(frozen=True)
class FittedTrace:
    """`StepTrace` numbers as a + b·tokens, read at any micro-batch."""

    depth: int
    intercept: dict[SegmentKey, Segment]
    slope: dict[SegmentKey, Segment]
    attention: str = ""  # the traces' (empty for a fit derived from others, memory_model.offload_trace)
    no_grad: frozenset[ParamKey] = frozenset()  # the traces' `StepTrace.no_grad`
    allocations: AllocationFit | None = None  # None: derived from other fits, no sequence of its own

    def at(self, key: SegmentKey, tokens: int) -> Segment:
        """The segment `key` at `tokens`. In a trace without block segments (`trace_step(block_segments=
        False)`) a block's reads as an even share of the whole forward (`fwd.pre`) or backward (`bwd.head`),
        for readers that want one block's size (the walk skips absent segments instead)."""
        if key not in self.intercept and key.phase in _WHOLE and not self.cut_per_block:
            whole = self.at(SegmentKey(key.micro_step, _WHOLE[key.phase]), tokens)
            share = (tuple(x / self.depth for x in v) for v in (whole.at_peak, whole.maxima, whole.end))
            return Segment(*share)
        a, b = self.intercept[key], self.slope[key]
        return Segment(*(_affine(getattr(a, f), getattr(b, f), tokens) for f in ("at_peak", "maxima", "end")))

    @property
    def cut_per_block(self) -> bool:
        """Whether the trace was cut at block boundaries (False: each phase of a micro-step is one segment)."""
        return any(key.phase == "fwd.block" for key in self.intercept)


def fit(small: StepTrace, large: StepTrace) -> FittedTrace:
    """The line through two traces of the same model at different token counts."""
    if small.tokens == large.tokens or small.segments.keys() != large.segments.keys():
        raise ValueError("fit needs two traces of the same model at two different micro-batch sizes")
    span = large.tokens - small.tokens
    intercept, slope = {}, {}
    for key, s in small.segments.items():
        g = large.segments[key]
        fields = ("at_peak", "maxima", "end")
        slopes = [
            tuple((y - x) / span for x, y in zip(getattr(s, f), getattr(g, f), strict=True)) for f in fields
        ]
        slope[key] = Segment(*slopes)
        intercept[key] = Segment(
            *(_affine(getattr(s, f), b, -small.tokens) for f, b in zip(fields, slopes, strict=True))
        )
    return FittedTrace(
        depth=small.depth,
        intercept=intercept,
        slope=slope,
        attention=small.attention,
        no_grad=small.no_grad,
        allocations=fit_allocations(
            small.allocations, small.tokens, large.allocations, large.tokens, large.gradient_allocations
        )
        if small.allocations and large.allocations
        else None,
    )


def clone_depth(num_blocks: int) -> int:
    return min(num_blocks, CLONE_DEPTH)


def trace_step(
    build_model: Callable[[], nn.Module],
    find_blocks: Callable[[nn.Module], list[nn.Module]],
    make_batch: Callable[[int], Batch],
    loss_fn: LossFn,
    precision: Precision,
    checkpointing: Checkpointing,
    micro_batch_size: int,
    weights_dtype: torch.dtype | None = None,
    adapters: Adapters | None = None,
    quantization: Quantization | None = None,
    loss: Loss | None = None,
    cuda_capability: Capability | None = None,
    block_segments: bool = True,
    compile: Compile | None = None,
) -> StepTrace:
    """Build the model under fake tensors with the strategies applied as the trainer applies them
    (`apply_strategies`) and trace two micro-steps of `micro_batch_size` rows. `make_batch(rows)` makes a
    real micro-batch, copied into fake tensors. `weights_dtype` overrides the dtype the forward reads
    weights in (FSDP2 and DeepSpeed hand bf16 weights to a bf16-mixed forward, so autocast has nothing to
    cast and cache). `cuda_capability`: attention runs as the CUDA kernel a GPU of this compute capability
    would run (attention_kernels.py); None: this process's CPU kernels. `block_segments=False`: no cuts at
    blocks, each micro-step's forward and backward are one segment each (for models whose blocks run more
    than once per forward, where block hooks would cut the step at the wrong places). `compile`: the plan's
    compile, applied as the run applies it; its compiled modules are traced as the compiled program
    (`compiled_trace.traced_as_compiled`)."""
    real_batch = make_batch(micro_batch_size)
    mode = fake_tensors()
    with mode:
        model = build_model()
        blocks = find_blocks(model)
        with _new_parameters_on_conversion():  # fake tensors cannot be swapped in place (adapters' `.to`)
            apply_strategies(
                model,
                blocks,
                precision,
                checkpointing,
                weights_dtype=weights_dtype,
                adapters=adapters,
                quantization=quantization,
                loss=loss,
                compile=compile,
            )
        model.train()
        with traced_as_compiled(model) as any_compiled:
            tracker = MemoryTracker(model, timeline=False, compiled_regions=any_compiled)  # reports alone
            recorder = _Recorder(tracker, blocks if block_segments else [])
            with (
                tracker,
                recorder.hooks(),
                traced_attention(cuda_capability) as attention,
                traced_dropout(cuda_capability),
                traced_grouped_mm(),
            ):
                recorder.log = tracker.record_allocations()  # from here: the model's states are not in it
                # Cloned under the tracker, so the batch is part of the level every segment starts from (as
                # the step's data is in the prediction's fixed bytes), not a first use inside a segment.
                batch: Batch = {k: mode.from_tensor(v).clone() for k, v in real_batch.items()}
                tokens = max(int(v.numel()) for v in batch.values())
                for kind in MICRO_STEPS:
                    recorder.micro_step = kind
                    recorder.mark(SegmentKey(kind, "fwd.pre"))
                    with tracker.phase("forward"):
                        with precision.autocast(torch.device("cpu")):
                            loss_sum, _ = loss_output(loss_fn(model, batch))
                            recorder.mark(SegmentKey(kind, "fwd.release"))
                    with tracker.phase("backward"):
                        recorder.mark(SegmentKey(kind, "bwd.head"))
                        (loss_sum * (1.0 / tokens)).backward()
                        recorder.mark(None)
                    del loss_sum
    return StepTrace(
        tokens=tokens,
        depth=len(blocks),
        segments=recorder.segments,
        attention=attention.describe(),
        reentered=recorder.reentered,
        no_grad=_without_gradient(model, blocks),
        allocations=recorder.pieces(),
        gradient_allocations=frozenset(recorder.log.gradients),
    )


def param_keys(model: nn.Module, blocks: Sequence[nn.Module]) -> dict[str, ParamKey]:
    """Every parameter's `ParamKey`, by its name in `model`."""
    inside = {id(p): (i, name) for i, block in enumerate(blocks) for name, p in block.named_parameters()}
    return {name: inside.get(id(p), (-1, name)) for name, p in model.named_parameters()}


def _without_gradient(model: nn.Module, blocks: Sequence[nn.Module]) -> frozenset[ParamKey]:
    """Trainable parameters the traced backward gave no gradient (used only through `.detach()`, or not
    at all: a DSA indexer's projections): the optimizer skips them, so they get no optimizer state either."""
    keys = param_keys(model, blocks)
    return frozenset(keys[n] for n, p in model.named_parameters() if p.requires_grad and p.grad is None)


@contextlib.contextmanager
def _new_parameters_on_conversion() -> Iterator[None]:
    """torch's own switch (`torch.__future__`) for `Module.to` to give converted parameters new objects
    instead of swapping their data in place, which fake tensors refuse; restored on exit."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)


class _Recorder:
    """Cuts the traced micro-steps into segments with the tracker's own step reports."""

    def __init__(self, tracker: MemoryTracker, blocks: Sequence[nn.Module]) -> None:
        self.tracker = tracker
        self.blocks = list(blocks)
        self.micro_step = MICRO_STEPS[0]
        self.segments: dict[SegmentKey, Segment] = {}
        self._open: SegmentKey | None = None
        self._start: Vec = ()
        self._entered: set[tuple[str, int]] = set()
        self.reentered = False  # a block's forward ran twice in one micro-step (cycles, shared blocks)
        self.log = AllocationLog()  # the tracker's (`record_allocations`)
        self._cuts: list[tuple[PieceKey, int]] = [(PieceKey(), 0)]

    def mark(self, key: SegmentKey | None) -> None:
        """Close the open segment and open `key` (None: just close)."""
        tracker = self.tracker
        if self._open is not None:
            report = tracker.end_step()
            self.segments[self._open] = _segment(self._start, report, _vec(tracker.snapshot()))
        self._open = key
        if key is not None:
            self._start = _vec(tracker.snapshot())
            tracker.begin_step(0)
        piece = PieceKey(self.micro_step) if key is None else PieceKey(key.micro_step, key.phase, key.block)
        self._cuts.append((piece, len(self.log.events)))

    def pieces(self) -> Pieces:
        """The allocation log cut where the segments begin and end (outside them: phase "")."""
        events = self.log.events
        ends = [at for _, at in self._cuts[1:]] + [len(events)]
        return tuple(
            (key, tuple(events[start:end])) for (key, start), end in zip(self._cuts, ends, strict=True)
        )

    def hooks(self) -> _Hooks:
        return _Hooks(self)

    def entering(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kind = self.micro_step
        self.reentered |= (kind, index) in self._entered
        self._entered.add((kind, index))
        self.mark(SegmentKey(kind, "fwd.block", index))
        if index == 0:
            _on_grad(_first_graph_tensor((args, kwargs)), lambda: self.mark(SegmentKey(kind, "bwd.pre")))

    def leaving(self, index: int, output: Any) -> None:
        kind = self.micro_step
        _on_grad(_first_graph_tensor(output), lambda: self.mark(SegmentKey(kind, "bwd.block", index)))
        if index == len(self.blocks) - 1:
            self.mark(SegmentKey(kind, "fwd.head"))


class _Hooks:
    def __init__(self, recorder: _Recorder) -> None:
        self._recorder = recorder
        self._handles: list[Any] = []

    def __enter__(self) -> None:
        r = self._recorder
        for index, block in enumerate(r.blocks):
            if is_compiled(block):  # a hook would run inside the compiled region: run them around it
                self._handles.append(_AroundCompiled(block, r, index))
                continue
            self._handles.append(
                block.register_forward_pre_hook(
                    lambda _m, args, kwargs, i=index: r.entering(i, args, kwargs), with_kwargs=True
                )
            )
            self._handles.append(block.register_forward_hook(lambda _m, _a, out, i=index: r.leaving(i, out)))

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()


class _AroundCompiled:
    """A compiled block's `entering` / `leaving` calls, made around its compiled call (removable)."""

    def __init__(self, block: nn.Module, recorder: _Recorder, index: int) -> None:
        self._block = block
        inner = block._compiled_call_impl
        assert inner is not None
        self._inner = inner

        def call(*args: Any, **kwargs: Any) -> Any:
            recorder.entering(index, args, kwargs)
            out = inner(*args, **kwargs)
            recorder.leaving(index, out)
            return out

        block._compiled_call_impl = call

    def remove(self) -> None:
        self._block._compiled_call_impl = self._inner


def _on_grad(tensor: torch.Tensor | None, callback: Callable[[], None]) -> None:
    if tensor is not None and torch.is_grad_enabled():
        tensor.register_hook(lambda _grad: callback())


def _first_graph_tensor(value: Any) -> torch.Tensor | None:
    return next(graph_tensors(value), None)


def _segment(start: Vec, report: StepMemory, end: Vec) -> Segment:
    at_peak = _vec(report.at_peak)
    maxima = _vec(report.component_peaks)
    return Segment(_minus(at_peak, start), _minus(maxima, start), _minus(end, start))


def _vec(by_component: dict[str, int]) -> Vec:
    return tuple(float(by_component[c]) for c in COMPONENTS)


def _minus(a: Vec, b: Vec) -> Vec:
    return tuple(x - y for x, y in zip(a, b, strict=True))


def _affine(a: Vec, b: Vec, tokens: int) -> Vec:
    return tuple(x + y * tokens for x, y in zip(a, b, strict=True))
