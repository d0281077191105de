"""The predicted peak of one plan: model states by arithmetic, activations by trace, composed over time.

Why composition and not a sum: the five components never peak together. Gradients are absent while the
first micro-step's forward builds its activations and grow while its backward frees them; every later
micro-step runs with all gradients present; the optimizer step has no activations but its own
temporaries (and, for bf16-master, fp32 master gradients). Adding each component's maximum would
over-predict by up to the gradients' size, so the planner replays a step instead:

1. model-state levels from the strategies' own estimates (`Precision`, `OptimizerStates`, the sharding
   backend's `state_bytes`), buffers and the step's data;
2. `walk`: the traced segments of a micro-step (activations.py), block by block over the real depth, each
   block with its own checkpointing mode (`fraction` mixes recomputed and plain blocks), starting from the
   model-state level; the first micro-step starts without gradients, later ones where the first ended;
3. the optimizer step: weights, states and gradients at their optimizer-time size plus the optimizer's
   temporaries (below) and, for bf16-master, the bf16→fp32 gradient hand-over.

The prediction is the highest of these moments, broken down as the tracker reports a peak (`at_peak`
sums to the peak), together with each component's own maximum (`maxima`).

Sharded plans (zero1/2/3) use the backend's per-rank `StateBytes` as one block (the backend's upper bound:
gathered weights, prefetch and gradient copies as if alive at once) and the walk's activations and
temporaries on top; gradient traffic inside backward is the backend's, not the trace's. What offload
moves to the host (`StateLevels.host`) is outside the device peak; the search holds it to the target's
host memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from memtrain.memory.footprint import COMPONENTS, Footprint, ModelShape
from memtrain.planner.activations import FittedTrace, Segment, SegmentKey, Vec
from memtrain.strategies.checkpointing import Checkpointing, FullCheckpointing, NoCheckpointing
from memtrain.strategies.optimizer import OptimizerStates

GRADIENTS = COMPONENTS.index("gradients")
_ZERO: Vec = (0.0,) * len(COMPONENTS)


@dataclass(frozen=True)
class StateLevels:
    """One rank's bytes outside the activations, from arithmetic.

    `gradients` is what backward leaves (bf16 for bf16-master); `optimizer_gradients` what the optimizer
    steps on; `optimizer_extra` the most the optimizer step holds above weights + states +
    optimizer_gradients; `other` buffers, backend buffers and the step's input data; `replicated`: the
    trace's own gradients are this rank's (none/ddp), else the backend's `gradients` stand for them.
    """

    weights: int
    optimizer_states: int
    gradients: int
    optimizer_gradients: int
    optimizer_extra: int
    other: int
    replicated: bool = True
    stored: tuple[int, int, int] = (0, 0, 0)  # weights, gradients, optimizer states kept between steps
    host: int = 0  # states offload keeps in host memory (`StateBytes.host`), outside the device peak
    paged: int = 0  # states in CUDA unified memory (`OptimizerStates.paged_bytes`): evictable, outside it too


@dataclass(frozen=True)
class Prediction:
    at_peak: Footprint
    maxima: Footprint
    where: str
    lower_bound: bool = False  # activations were not traced (the model states alone do not fit)
    reserved: int | None = (
        None  # the CUDA caching allocator's segments at this step (reserved.py); None: not replayed
    )
    reserved_expandable: int | None = None  # the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    margin: float = (
        0.0  # planner.reserved_margin: the share added to `reserved` before it is held to a budget
    )
    # the step's two highest moments: the micro-steps' (with the states at rest) and the optimizer step's;
    # the mesh search divides each by the mesh and takes the higher (planner/mesh_cost.py)
    moments: tuple[Footprint, ...] = ()

    @property
    def peak(self) -> int:
        return self.at_peak.peak

    @property
    def required(self) -> int:
        """The bytes that must fit: the peak, or with a replayed allocator its reserved bytes and margin."""
        return required_bytes(self.peak, self.reserved, self.margin)

    @property
    def required_expandable(self) -> int | None:
        """`required` with expandable segments (None: not replayed)."""
        if self.reserved_expandable is None:
            return None
        return required_bytes(self.peak, self.reserved_expandable, self.margin)


def required_bytes(peak: int, reserved: int | None, margin: float) -> int:
    """What must fit a budget: the allocated `peak`, or, when the caching allocator was replayed, its
    `reserved` bytes plus the `margin` share (planner.reserved_margin) if that is more. One rule for a
    one-device plan (`Prediction`) and a mesh plan (`mesh_search.MeshScored`)."""
    return peak if reserved is None else max(peak, reserved + int(reserved * margin))


def offload_trace(none: FittedTrace, full: FittedTrace) -> FittedTrace:
    """Offloaded blocks on CUDA: each block runs its forward as without checkpointing but leaves only what a
    recomputed block leaves (its saved tensors went to the host); its backward brings them back."""

    def derive(table: str) -> dict[SegmentKey, Segment]:
        plain, recomputed = getattr(none, table), getattr(full, table)
        out = dict(plain)
        for key, seg in plain.items():
            if key.phase != "fwd.block":
                continue
            moved = _minus(seg.end, recomputed[key].end)
            out[key] = Segment(seg.at_peak, seg.maxima, recomputed[key].end)
            back = SegmentKey(key.micro_step, "bwd.block", key.block)
            b = plain[back]
            out[back] = Segment(_plus(b.at_peak, moved), _plus(b.maxima, moved), _plus(b.end, moved))
        return out

    return FittedTrace(depth=none.depth, intercept=derive("intercept"), slope=derive("slope"))


@dataclass(frozen=True)
class Walk:
    """One replayed micro-step, relative to the level it started from (walks add to any start)."""

    at_peak: Vec
    maxima: Vec
    end: Vec
    where: str


@dataclass(frozen=True)
class StepWalk:
    """The first micro-step and, with accumulation, a later one (which starts where the first ended)."""

    first: Walk
    later: Walk | None
    traced: bool = True  # False: no activations (a lower bound for plans whose states alone do not fit)


Traces = Mapping[Checkpointing, FittedTrace]


@dataclass(frozen=True)
class EdgePattern(Checkpointing):
    """A traced mode, never a recipe's: the traced blocks recompute their forward (as `full`) where
    `recomputed` says, so a trace has the first, a middle and the last block in the modes of the real
    blocks they stand for (`edge_pattern`).

    Why: a mode that mixes recomputed and plain blocks (`fraction`) is walked block by block from the `none`
    and `full` traces, but what the model makes before its blocks and hands to each of them (an eager
    attention mask, position ids) lives as long as the last block that keeps it: a recomputed block keeps
    its inputs until its backward, a plain one only what autograd saves (a mask added to the attention
    scores is not saved, so without recompute it is freed when the forward returns). The `none` trace's
    head segment frees it, the `full` trace's first block frees it in backward: read from the uniform
    traces, a walk with its first blocks recomputed and its last plain freed it twice, one mask per
    micro-step below the truth (tiny Mixtral, eager, fraction 0.5: -0.90%). So the segments outside the
    blocks (embeddings, head, loss) are read from a trace of this pattern (`walk`).
    """

    name: ClassVar[str] = "edges"
    recompute: ClassVar[str] = "forward"
    recomputed: tuple[bool, ...] = ()

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        if num_blocks != len(self.recomputed):
            raise ValueError(f"EdgePattern of {len(self.recomputed)} blocks applied to {num_blocks}")
        return self.recomputed

    def describe(self) -> str:
        return "blocks " + "".join("R" if again else "-" for again in self.recomputed)


def edge_pattern(modes: Sequence[Checkpointing], depth: int) -> EdgePattern | None:
    """The pattern a walk of `modes` (one per real block) reads its segments outside the blocks from, for a
    trace of `depth` blocks (the clone's first, middle and last stand for the real first, second and last;
    a model traced whole has its own); None where every block has one mode or a mode other than `none` and
    `full` (nothing to mix)."""
    plain, recomputed = NoCheckpointing(), FullCheckpointing()
    if len(set(modes)) < 2 or not set(modes) <= {plain, recomputed}:
        return None
    chosen = list(modes) if depth >= len(modes) else [modes[0], *[modes[1]] * (depth - 2), modes[-1]]
    return EdgePattern(tuple(mode == recomputed for mode in chosen))


def step_walk(
    traces: Traces,
    modes: Sequence[Checkpointing],
    tokens: int,
    accumulation_steps: int,
    replicated: bool = True,
) -> StepWalk:
    first = walk(traces, modes, tokens, "first", _ZERO, replicated)
    later = walk(traces, modes, tokens, "later", first.end, replicated) if accumulation_steps > 1 else None
    return StepWalk(first, later)


def walk(
    traces: Traces,
    modes: Sequence[Checkpointing],
    tokens: int,
    micro_step: str,
    start: Vec,
    replicated: bool = True,
) -> Walk:
    """Replay one micro-step of `len(modes)` blocks from the level `start`.

    Block 0 of the real model reads the clone's block 0, its last block the clone's last, every other
    block the clone's block 1 (a model traced whole reads its own blocks); the head and the loss read the
    last block's mode, the embeddings the first's. A run of identical blocks changes the level by the same amount per block, so its highest
    moment is in its first or its last block: runs cost two evaluations, whatever the depth.

    A mixed walk reads the segments outside the blocks from the trace keyed by an `EdgePattern` where
    `traces` has one (`EdgePattern`: why), and every segment from it when it was traced at the real depth
    (a model traced whole: exact).

    Traces without block segments (a model whose blocks run several times per forward, model_probe.py)
    hold each phase whole, each in one mode for every block. The search traces a mode that mixes blocks
    (`fraction`) as itself over such a model (search._traced_as_itself), exact; only a walk asked for
    before the first trace found the blocks re-entered mixes modes here: each mode is walked for the
    whole model and the highest walk is taken (on the safe side).
    """
    if len(set(modes)) > 1 and not all(trace.cut_per_block for trace in traces.values()):
        uniform = (
            walk(traces, (m,) * len(modes), tokens, micro_step, start, replicated)
            for m in dict.fromkeys(modes)
        )
        return max(uniform, key=lambda w: sum(w.at_peak))
    depth = min(trace.depth for trace in traces.values())
    edges: Checkpointing | None = (
        next((m for m in traces if isinstance(m, EdgePattern)), None) if len(set(modes)) > 1 else None
    )
    if not modes:  # a model without blocks: every phase is outside them, in the one mode traced
        edges = next(iter(traces))
    if edges is not None and traces[edges].depth == len(modes):
        modes = (edges,) * len(modes)
    level, best, maxima, where = start, start, start, "start"
    for phase, first_index, count, clone_index, mode in _runs(modes, depth, edges):
        key = SegmentKey(micro_step, phase, clone_index)
        if key not in traces[mode].intercept:  # e.g. no backward below the first block: a frozen embedding
            continue
        seg = traces[mode].at(key, tokens)
        if not replicated:
            seg = Segment(*(_without_gradients(v) for v in (seg.at_peak, seg.maxima, seg.end)))
        if phase == "fwd.release":  # only frees: the clone's `depth` blocks' share, for `count` blocks
            level = _plus(level, _times(seg.end, count / depth))
            continue
        for offset in {0, count - 1}:
            base = _plus(level, _times(seg.end, offset))
            here = _plus(base, seg.at_peak)
            if sum(here) > sum(best):
                index = first_index + (offset if phase.startswith("fwd") else -offset)
                best, where = here, _describe(micro_step, phase, index)
            maxima = tuple(max(m, x) for m, x in zip(maxima, _plus(base, seg.maxima), strict=True))
        level = _plus(level, _times(seg.end, count))
    return Walk(best, maxima, level, where)


Run = tuple[str, int, int, int, Checkpointing]


def _runs(modes: Sequence[Checkpointing], depth: int, edges: Checkpointing | None = None) -> list[Run]:
    """(phase, first block index, blocks in the run, clone block index, mode) in execution order; the
    phases outside the blocks in `edges` where given, else in the first or the last block's mode."""
    count = len(modes)
    before, after = edges or modes[0], edges or modes[-1]

    def clone_index(i: int) -> int:
        if count <= depth:
            return i
        return 0 if i == 0 else depth - 1 if i == count - 1 else 1

    forward: list[Run] = []
    for i, mode in enumerate(modes):
        last = forward[-1] if forward else None
        if last is not None and last[4] == mode and last[3] == clone_index(i) == 1:
            forward[-1] = (last[0], last[1], last[2] + 1, last[3], mode)
        else:
            forward.append(("fwd.block", i, 1, clone_index(i), mode))
    backward = [
        ("bwd.block", first + n - 1, n, index, mode) for _, first, n, index, mode in reversed(forward)
    ]
    release = [("fwd.release", -1, modes.count(mode), -1, mode) for mode in dict.fromkeys(modes)]
    return [
        ("fwd.pre", -1, 1, -1, before),
        *forward,
        ("fwd.head", -1, 1, -1, after),
        *release,
        ("bwd.head", -1, 1, -1, after),
        *backward,
        ("bwd.pre", -1, 1, -1, before),
    ]


def predict(levels: StateLevels, walks: StepWalk) -> Prediction:
    """The step's peak: the first micro-step, a later one (with accumulation), or the optimizer step."""
    rest = (
        float(levels.weights),
        float(levels.gradients if not levels.replicated else 0),
        float(levels.optimizer_states),
        0.0,
        float(levels.other),
    )
    moments = [w for w in (walks.first, walks.later) if w is not None]
    optimizer = (
        float(levels.weights),
        float(levels.optimizer_gradients),
        float(levels.optimizer_states),
        0.0,
        float(levels.other + levels.optimizer_extra),
    )
    best = max(moments, key=lambda w: sum(w.at_peak))
    maxima = tuple(
        max(values) for values in zip(*(_plus(rest, w.maxima) for w in moments), optimizer, strict=True)
    )
    bound = not walks.traced
    highest = (_footprint(_plus(rest, best.at_peak)), _footprint(optimizer))
    if sum(optimizer) > sum(rest) + sum(best.at_peak):
        return Prediction(highest[1], _footprint(maxima), "optimizer step", bound, moments=highest)
    return Prediction(highest[0], _footprint(maxima), best.where, bound, moments=highest)


def optimizer_extra(
    shape: ModelShape, optimizer_states: OptimizerStates, foreach: bool, master_handover: bool
) -> int:
    """Bytes the optimizer step holds above weights, states and fp32 gradients, over the trainable
    parameters in `shape`.

    torch's fused AdamW (what `fp32` states build on CUDA and the CPU) updates in place
    (`fused_temporaries`). Per-tensor optimizers (the bf16-state AdamW, Adafactor off CUDA) hold fp32
    temporaries of one tensor at a time, or of one chunk of it where the step works in chunks
    (`OptimizerStates.step_elements`), and torch's per-tensor loop still holds the previous tensor's `denom`
    while it makes the next one's (`per_tensor_carried`): the highest moment is at the tensor whose own
    temporaries plus its predecessor's carried ones are largest, in the optimizer's (the model's) parameter
    order. torch's foreach optimizers (their CUDA default) hold fp32 temporaries of all parameters
    (`foreach_temporaries`). bf16-master first hands the bf16 gradients over as fp32 master gradients,
    tensor by tensor: the bf16 gradients not yet converted are still alive then, and with optimizers without
    temporaries (8-bit, fused) that is the higher moment.
    """
    trainable = shape.trainable
    if optimizer_states.fused_temporaries is not None:
        extra = optimizer_states.fused_temporaries * 4 * trainable.numel
    elif foreach and optimizer_states.foreach_temporaries is not None:
        extra = optimizer_states.foreach_temporaries * 4 * trainable.numel
    else:
        sizes = [optimizer_states.step_elements(p.numel) for p in trainable.params]
        own, carried = optimizer_states.per_tensor_temporaries, optimizer_states.per_tensor_carried
        befores = [0, *sizes][: len(sizes)]  # each tensor's predecessor in the step (none for the first)
        extra = 4 * max((own * n + carried * b for b, n in zip(befores, sizes, strict=True)), default=0)
    if master_handover:
        done, handover, total = 0, 0, trainable.numel
        for (
            p
        ) in trainable.params:  # bf16 of the rest + fp32 of those done + this one's fp32 copy, over 4·numel
            handover = max(handover, 2 * (total - done) + 4 * done + 4 * p.numel - 4 * total)
            done += p.numel
        extra = max(extra, handover)
    return extra


def _describe(micro_step: str, phase: str, index: int) -> str:
    direction = "forward" if phase.startswith("fwd") else "backward"
    part = {"pre": "embeddings", "head": "head and loss"}.get(phase.split(".")[1], f"block {index}")
    return f"{direction}, {part}, {micro_step} micro-step"


def _times(v: Vec, n: float) -> Vec:
    return tuple(x * n for x in v)


def _without_gradients(v: Vec) -> Vec:
    return tuple(0.0 if i == GRADIENTS else x for i, x in enumerate(v))


def _footprint(v: Vec) -> Footprint:
    return Footprint(**{name: max(0, round(x)) for name, x in zip(COMPONENTS, v, strict=True)})


def _plus(a: Vec, b: Vec) -> Vec:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _minus(a: Vec, b: Vec) -> Vec:
    return tuple(x - y for x, y in zip(a, b, strict=True))
