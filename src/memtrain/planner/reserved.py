"""Reserved memory per plan: the traced allocation sequence at the real depth, replayed through the model
of the CUDA caching allocator (memory/caching_allocator.py).

Why the allocator's overhead added to the predicted peak: the traced sequence holds what a step makes and
frees (activations, a replicated model's gradients, the step's data, temporaries); the model states come
from arithmetic (memory_model.py) and are allocated once, before the first step, and kept, so they add the
same bytes to allocated and reserved memory. A plan's reserved bytes are therefore its predicted peak plus
what the allocator holds above the live bytes over the sequence: the replay's reserved peak less its
allocated peak. Two training steps are replayed, the second from the cache the first left (its gradients
freed by `zero_grad`), because the cache carries over; later steps are taken to repeat the second.

Why the whole depth (allocation_trace.whole_depth) and not a few blocks: measured on a 12-block tiny llama
(hidden 1024, 512 tokens; fp32 and bf16-mixed, with and without full recompute) the sequence synthesized
from the 3-block clone replays to the same allocated and reserved peaks as a trace of all 12 blocks, to the
byte; and the overhead is not linear in depth (bf16-mixed with full recompute at 6, 10, 18, 34 and 80
blocks: 32, 37, 24, 32 and 95 MB), so no shorter replay stands for a deep model.

Why lazily: a replay of 80 blocks in both modes costs about a second, so the search replays plans in
its rank order only until the chosen plan and its runners-up fit (search.py), each (trace, micro-batch,
accumulation) once.

A sharded plan (zero2/zero3) replays the sequence with each unsharded gradient freed at the end of its
block's backward: it is reduce-scattered into its shard then, whose bytes the backend's arithmetic counts
(exact for a reduce-scatter every micro-step; a plan that accumulates unsharded gradients until the last
micro-step keeps them longer). Not modelled:
sharded plans' gathers, reduce-scatters and bucket buffers (not traced: their bytes are in the peak by
arithmetic, the fragmentation they cause is not), the optimizer step's temporaries (they
reuse the cache the activations left), NCCL's and cuBLAS's own memory (outside the caching allocator: the
budget's reserve), and what the allocator model leaves out (its docstring). `planner.reserved_margin`
is the share added for these before a plan's reserved bytes are held to the budget.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from memtrain.memory.caching_allocator import replay
from memtrain.memory.cuda_stats import expandable_segments_enabled, expandable_segments_in_environment
from memtrain.planner import trace_cache
from memtrain.planner.allocation_trace import AllocationFit, whole_depth
from memtrain.planner.memory_model import Prediction, Traces

STEPS = 2  # the first step fills the cache, the second allocates from what it left


@dataclass(frozen=True)
class Overhead:
    """Bytes the allocator holds above the live ones at its reserved peak, per allocator mode."""

    default: int
    expandable: int


def expandable_in_effect(what_if: bool) -> bool:
    """Whether the planned CUDA run gets expandable segments: this process's allocator settings on its own
    GPU, the environment the plan is made in for a what-if GPU (torch's default, off, when unset)."""
    return expandable_segments_in_environment() if what_if else expandable_segments_enabled()


class ReservedModel:
    """Each plan's reserved bytes, from the traces the search walked it with (cached per sequence)."""

    def __init__(self, num_blocks: int, expandable: bool, margin: float) -> None:
        self.num_blocks, self.expandable, self.margin = num_blocks, expandable, margin
        self._cache: dict[tuple[int, int, bool, bool], Overhead] = {}
        self._kept: dict[int, AllocationFit] = {}  # the fits the cache's ids name, kept alive
        self.replays = self.read = 0  # sequences replayed, and read from the trace cache (progress lines)

    def apply(
        self, prediction: Prediction, traces: Traces, tokens: int, accumulated: bool, replicated: bool
    ) -> Prediction:
        """`prediction` with its reserved bytes in the mode in effect and with expandable segments; as it
        was when no trace holds a sequence or the activations were not traced (a lower bound).
        `replicated`: the plan keeps whole gradients (else each lives through its block's backward only:
        `AllocationFit.at`)."""
        overhead = self.overhead(traces, tokens, accumulated, replicated)
        if overhead is None or prediction.lower_bound:
            return prediction
        mine = overhead.expandable if self.expandable else overhead.default
        return replace(
            prediction,
            reserved=prediction.peak + mine,
            reserved_expandable=prediction.peak + overhead.expandable,
            margin=self.margin,
        )

    def overhead(self, traces: Traces, tokens: int, accumulated: bool, replicated: bool) -> Overhead | None:
        """The largest overhead over the traced modes a plan is walked with (a mode mixing recomputed and
        plain blocks takes the larger of its two)."""
        found = [
            self._of(trace.allocations, trace.depth, tokens, accumulated, replicated)
            for trace in traces.values()
            if trace.allocations is not None
        ]
        if not found:
            return None
        return Overhead(max(o.default for o in found), max(o.expandable for o in found))

    def _of(
        self, fit: AllocationFit, depth: int, tokens: int, accumulated: bool, replicated: bool
    ) -> Overhead:
        key = (id(fit), tokens, accumulated, replicated)
        if key not in self._cache:
            self._kept[id(fit)] = fit
            stored = trace_cache.numbers_key(
                "reserved overhead",
                _digest(fit),
                self.num_blocks,
                depth,
                tokens,
                accumulated,
                replicated,
                STEPS,
            )
            found = trace_cache.load_numbers(stored) if stored is not None else None
            if found is not None and len(found) == 2:
                self._cache[key] = Overhead(*found)
                self.read += 1
                return self._cache[key]
            pieces = fit.at(tokens, kept_gradients=replicated)
            if not accumulated:  # one micro-step a step: the later micro-step's pieces are not run
                pieces = tuple(piece for piece in pieces if piece[0].micro_step != "later")
            events = whole_depth(pieces, self.num_blocks, depth, steps=STEPS).events
            self.replays += 1
            default, grown = replay(events), replay(events, expandable_segments=True)
            self._cache[key] = Overhead(
                default.reserved_peak - default.allocated_peak, grown.reserved_peak - grown.allocated_peak
            )
            if stored is not None:
                trace_cache.store_numbers(stored, [self._cache[key].default, self._cache[key].expandable])
        return self._cache[key]


def _digest(fit: AllocationFit) -> str:
    """A digest of everything `fit` holds (the trace cache's key of its replays: equal digests, equal
    sequences)."""
    text = repr((fit.keys, fit.ids, fit.intercept, fit.slope, sorted(fit.gradients)))
    return hashlib.sha256(text.encode()).hexdigest()
