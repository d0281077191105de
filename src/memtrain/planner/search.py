"""Search: predict the peak of every candidate, keep those that fit, rank them by predicted step time.

Why exhaustive: the grid is a few hundred to a few thousand candidates, and after the traces (a handful,
cached per precision and checkpointing mode) a prediction is arithmetic over a dozen segments, so every
candidate is evaluated and none is pruned by a heuristic that could be wrong. The order is total and
depends only on the inputs (time, then peak, then the plan's fields), so every rank and every rerun picks
the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch

from memtrain.errors import PlanError, Unsupported
from memtrain.footprint import Footprint
from memtrain.plan import Plan, per_rank_batch, sharding_options
from memtrain.planner.activations import FittedTrace, SegmentKey
from memtrain.planner.candidates import Candidate, Grid, build_grid
from memtrain.planner.cost import CostModel, StepCost, Workload
from memtrain.planner.hardware import MemoryBudget, Target
from memtrain.planner.memory_model import (
    Prediction,
    StateLevels,
    StepWalk,
    Walk,
    block_modes,
    offload_trace,
    predict,
    step_walk,
    traced_modes,
)
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.states import REPLICATED, host_dataset_bytes, state_levels, step_data_bytes
from memtrain.recipe import Recipe
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.sharding import make_sharding

ACTIVATIONS = 3  # index of the activations component in a Vec
STATES_ONLY = StepWalk(Walk((0.0,) * 5, (0.0,) * 5, (0.0,) * 5, "model states alone (activations not traced)"),
                       None, traced=False)


@dataclass(frozen=True)
class Scored:
    """A candidate with its predicted peak and step time."""

    candidate: Candidate
    prediction: Prediction
    cost: StepCost
    states: StateLevels

    def short(self, usable: int) -> int:
        """Bytes over `usable` (0 when it fits)."""
        return max(0, self.prediction.peak - usable)

    def order(self) -> tuple[Any, ...]:
        """Faster first; then smaller; then the plan's fields, so that the order is total."""
        return (round(self.cost.total, 12), self.prediction.peak, astuple(self.candidate))

    def to_dict(self, usable: int) -> dict[str, Any]:
        return {**self.candidate.__dict__, "predicted_peak": self.prediction.peak,
                "predicted_peak_is_lower_bound": self.prediction.lower_bound,
                "predicted_step_seconds": self.cost.total, "fits": self.short(usable) == 0,
                "short_bytes": self.short(usable)}


def rank(scored: Sequence[Scored], usable: int) -> tuple[tuple[Scored, ...], tuple[Scored, ...]]:
    """(the plans that fit in `usable` bytes, those that do not), each fastest first."""
    fits = tuple(sorted((s for s in scored if s.prediction.peak <= usable), key=Scored.order))
    misfits = tuple(sorted((s for s in scored if s.prediction.peak > usable), key=Scored.order))
    return fits, misfits


@dataclass(frozen=True)
class PlanResult:
    """The plan a run trains with and, when the planner chose it, what it predicted and why."""

    plan: Plan
    backend: str
    offload: str
    budget: MemoryBudget | None = None
    chosen: Scored | None = None
    ranked: tuple[Scored, ...] = ()  # plans that fit, fastest first (the chosen one first)
    infeasible: tuple[Scored, ...] = ()  # plans that do not fit, fastest first
    excluded: tuple[tuple[str, str], ...] = ()  # (option, why it cannot run here)

    @property
    def predicted(self) -> Footprint | None:
        return self.chosen.prediction.at_peak if self.chosen is not None else None

    @property
    def cheapest_infeasible(self) -> Scored | None:
        return self.infeasible[0] if self.infeasible else None


def search(recipe: Recipe, probe: ModelProbe, target: Target, device: torch.device, *, what_if: bool,
           cost: CostModel | None = None) -> PlanResult:
    """Evaluate every candidate of the recipe on `target`; `PlanError` (with the table) when none fits."""
    from memtrain.planner.explain import explain_failure

    grid = build_grid(recipe, device, target.world_size, probe.num_blocks, bf16=target.bf16, fp8=target.fp8,
                      what_if=what_if)
    evaluation = _Evaluation(recipe, probe, target, cost or CostModel.for_device(target.device_type), grid)
    excluded = list(grid.excluded)
    scored: list[Scored] = []
    for candidate in grid.candidates:
        try:
            scored.append(evaluation.score(candidate))
        except Unsupported as exc:  # the trace of this precision and mode failed
            reason = (f"strategies.precision={candidate.precision} with checkpointing={candidate.checkpointing}",
                      str(exc))
            if reason not in excluded:
                excluded.append(reason)
    ranked, infeasible = rank(scored, target.budget.usable)
    if not ranked:
        raise PlanError(explain_failure(recipe, target.budget, infeasible, tuple(excluded)))
    s = recipe.strategies
    return PlanResult(plan=ranked[0].candidate.plan(target.world_size), backend=s.sharding_backend,
                      offload=s.sharding_offload, budget=target.budget, chosen=ranked[0], ranked=ranked,
                      infeasible=infeasible, excluded=tuple(excluded))


class _Evaluation:
    """Scores candidates, sharing traces (in the probe), walks and model-state levels between them."""

    def __init__(self, recipe: Recipe, probe: ModelProbe, target: Target, cost: CostModel, grid: Grid) -> None:
        self.recipe, self.probe, self.target, self.cost = recipe, probe, target, cost
        seq = probe.seq_len
        sizes = sorted({-(-c.tokens(seq) // seq) for c in grid.candidates}) or [1]
        self.rows = (sizes[0], sizes[-1])  # the traced micro-batch sizes: the ends of the range
        per_rank = per_rank_batch(recipe, target.world_size)
        self.fixed = probe.buffer_bytes + step_data_bytes(per_rank, seq)
        if target.device_type == "cpu":
            self.fixed += host_dataset_bytes(recipe)
        self.workload = Workload(
            numel=probe.shape.numel, block_numel=sum(p.numel for p in probe.shape.params if p.block is not None),
            num_blocks=probe.num_blocks, hidden=probe.hidden_size, seq_len=seq, rows_per_step=per_rank,
            world_size=target.world_size)
        self.walks: dict[tuple[Any, ...], StepWalk] = {}
        self.states: dict[tuple[Any, ...], StateLevels] = {}

    def score(self, c: Candidate) -> Scored:
        probe, target = self.probe, self.target
        tokens, micro_steps = c.tokens(probe.seq_len), c.micro_steps(probe.seq_len)
        recomputed = Checkpointing(c.checkpointing, c.checkpointing_fraction).checkpointed(probe.num_blocks)
        levels = self._levels(c, micro_steps)
        offloaded = 0
        if predict(levels, STATES_ONLY).peak > target.budget.usable:
            walk = STATES_ONLY  # the model states alone do not fit: no trace can change that
        else:
            bf16_weights = _bf16_weights(c, self.recipe.strategies.sharding_backend)
            traces = _traces(probe, c.precision, c.checkpointing, target.device_type, self.rows, bf16_weights)
            replicated = c.sharding in REPLICATED
            key = (c.precision, c.checkpointing, c.checkpointing_fraction, tokens, micro_steps > 1, replicated,
                   bf16_weights)
            if key not in self.walks:
                modes = block_modes(c.checkpointing, recomputed, target.device_type)
                self.walks[key] = step_walk(traces, modes, tokens, micro_steps, replicated)
            walk = self.walks[key]
            if c.checkpointing == "offload":
                offloaded = probe.num_blocks * _kept_per_block(traces["none"], tokens)
        step = self.cost.step(
            self.workload, precision=c.precision, checkpointing=c.checkpointing,
            recomputed_share=sum(recomputed) / max(probe.num_blocks, 1), optimizer_states=c.optimizer_states,
            sharding=c.sharding, sharding_offload=self.recipe.strategies.sharding_offload, micro_tokens=tokens,
            micro_steps=micro_steps, state_bytes=levels.weights + levels.optimizer_gradients + levels.optimizer_states,
            offloaded_activation_bytes=offloaded, device_type=target.device_type)
        return Scored(c, predict(levels, walk), step, levels)

    def _levels(self, c: Candidate, micro_steps: int) -> StateLevels:
        key = (c.precision, c.optimizer_states, c.sharding, micro_steps > 1)
        if key not in self.states:  # the sharding arithmetic visits every rank: once per key
            options = sharding_options(self.recipe, c.precision, c.micro_batch_size, micro_steps)
            self.states[key] = state_levels(
                self.probe.shape, precision=c.precision, optimizer_states=c.optimizer_states,
                backend=make_sharding(c.sharding, **options), world_size=self.target.world_size,
                dim0=self.probe.dim0, fixed_bytes=self.fixed, foreach=self.target.device_type == "cuda")
        return self.states[key]


def _bf16_weights(candidate: Candidate, backend: str) -> bool:
    """Whether the forward reads bf16 weights handed over by the sharding backend (bf16-mixed on FSDP2's
    zero2/zero3 mixed-precision policy, or on any DeepSpeed stage's bf16 mode) instead of casting fp32 ones."""
    sharded = candidate.sharding in (("zero2", "zero3") if backend == "fsdp2" else ("zero1", "zero2", "zero3"))
    return candidate.precision == "bf16-mixed" and sharded


def _traces(probe: ModelProbe, precision: str, checkpointing: str, device_type: str,
            rows: tuple[int, int], bf16_weights: bool) -> dict[str, FittedTrace]:
    traces = {mode: probe.trace(precision, mode, rows, bf16_weights)
              for mode in traced_modes(checkpointing, device_type)}
    if checkpointing == "offload" and device_type == "cuda":
        traces["offload"] = offload_trace(traces["none"], traces["full"])
    return traces


def _kept_per_block(trace: FittedTrace, tokens: int) -> int:
    middle = 1 if trace.depth > 2 else 0
    return int(trace.at(SegmentKey("first", "fwd.block", middle), tokens).end[ACTIVATIONS])

