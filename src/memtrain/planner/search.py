"""Search: predict the peak of every candidate, keep those that fit, rank them by predicted step time.

Why exhaustive: the grid is a few hundred to a few thousand candidates, and after the traces (a handful,
cached per precision and checkpointing mode) a prediction is arithmetic over a dozen segments, so every
candidate is evaluated and none is pruned by a heuristic that could be wrong. The order is total and
depends only on the inputs (time, then peak, then the plan's strategies), so every rank and every rerun
picks the same plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from memtrain.errors import PlanError, Unsupported
from memtrain.memory.footprint import ModelShape
from memtrain.memory.headroom import Target
from memtrain.plan import Plan, per_rank_batch
from memtrain.planner import in_backward as in_backward_memory
from memtrain.planner.activations import FittedTrace, SegmentKey
from memtrain.planner.candidates import Grid, build_grid
from memtrain.planner.cost import CostModel, Workload
from memtrain.planner.explain import RUNNERS_UP, explain_failure
from memtrain.planner.memory_model import (
    Prediction,
    StateLevels,
    StepWalk,
    Traces,
    Walk,
    edge_pattern,
    offload_trace,
    predict,
    step_walk,
)
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.prediction_error import reserved_margin
from memtrain.planner.rank_trace import RankTraces
from memtrain.planner.reserved import ReservedModel, expandable_in_effect
from memtrain.planner.result import PlanResult, Scored, expandable_choice, rank
from memtrain.planner.states import state_levels
from memtrain.recipe import Recipe
from memtrain.strategies.checkpointing import Checkpointing, FullCheckpointing, NoCheckpointing
from memtrain.strategies.optimizer_step import OptimizerStep
from memtrain.strategies.precision import Precision
from memtrain.strategies.registry import DeviceFacts

ACTIVATIONS = 3  # index of the activations component in a Vec
MICRO_SIZE_RETRIES = 2  # smallest micro-batch sizes dropped when no plan's step could be traced
STATES_ONLY = StepWalk(
    Walk((0.0,) * 5, (0.0,) * 5, (0.0,) * 5, "model states alone (activations not traced)"),
    None,
    traced=False,
)


class HostMemoryExceeded(Unsupported):
    """A plan's offloaded states do not fit in the target's host memory (a candidate that does not fit,
    not a trace that failed)."""


def search(
    recipe: Recipe,
    probe: ModelProbe,
    target: Target,
    device: torch.device,
    *,
    cost: CostModel | None = None,
    correction: Callable[[Prediction], Prediction] | None = None,
) -> PlanResult:
    """Evaluate every candidate of the recipe on `target`; `PlanError` (with the table) when none fits.
    `correction` adjusts every candidate's prediction before ranking (a run that measured more than its
    plan predicted re-plans with it: memtrain.training.replan)."""
    # a mesh pinned on this CPU: each candidate's busiest rank traced as the trainer runs it (rank_trace.py);
    # its kernels are this CPU's, so a CUDA target keeps the traces of one device with the states divided
    on_a_mesh = target.mesh is not None and not target.mesh.is_flat and target.device_type == "cpu"
    started, before = time.process_time(), (probe.sizes_traced, probe.sizes_read)
    scoring = score_candidates(
        recipe, probe, target, device, cost=cost, correction=correction, rank_traces=on_a_mesh
    )
    traced, read = probe.sizes_traced - before[0], probe.sizes_read - before[1]
    probe.progress(
        f"scored {len(scoring.scored)} candidates in {time.process_time() - started:.1f} s of CPU "
        f"({traced} sizes traced, {read} read from the trace cache)"
    )
    grid, evaluation, scored, excluded = scoring.grid, scoring.evaluation, scoring.scored, scoring.excluded
    untraceable = scoring.untraceable
    if untraceable is not None and not scored:  # not "no plan fits": no plan could be predicted at all
        raise untraceable
    expandable = None
    if target.device_type == "cuda":
        expandable = expandable_in_effect(target.what_if)
        reserved = ReservedModel(
            probe.num_blocks, expandable, reserved_margin(recipe.planner.reserved_margin)
        )
        started = time.process_time()
        scored = _with_reserved(scored, evaluation, reserved, target.budget.usable)
        probe.progress(
            f"reserved bytes: {reserved.replays} allocation sequences replayed at {probe.num_blocks} blocks "
            f"in {time.process_time() - started:.1f} s of CPU ({reserved.read} read from the trace cache)"
        )
    ranked, infeasible = rank(scored, target.budget.usable)
    if not ranked:
        raise PlanError(
            explain_failure(recipe, target.budget, infeasible, tuple(excluded), ruled_out=not grid.candidates)
        )
    chosen = ranked[0]
    return PlanResult(
        plan=chosen.plan,
        budget=target.budget,
        chosen=chosen,
        ranked=ranked,
        infeasible=infeasible,
        excluded=tuple(excluded),
        full_fine_tuning=evaluation.full_fine_tuning(chosen.plan),
        attention=""
        if chosen.predicted_by == "rank trace"
        else _attention(probe, chosen.plan, target, evaluation.rows_of(chosen.plan)),
        expandable_segments=expandable,
        with_expandable=expandable_choice(infeasible, target.budget.usable, chosen)
        if expandable is False
        else None,
    )


@dataclass(frozen=True)
class Scoring:
    """Every candidate of a grid scored on one target (`score_candidates`)."""

    grid: Grid
    evaluation: Evaluation
    scored: list[Scored]
    excluded: list[tuple[str, str]]
    untraceable: Unsupported | None


def score_candidates(
    recipe: Recipe,
    probe: ModelProbe,
    target: Target,
    device: torch.device,
    *,
    cost: CostModel | None = None,
    correction: Callable[[Prediction], Prediction] | None = None,
    rank_traces: bool = False,
) -> Scoring:
    """Predict every candidate of the recipe's grid on `target`; those that cannot be predicted (host
    memory, a trace that failed) become exclusions. The mesh search (mesh_search.py) scores each data-parallel
    arrangement through this and divides the result by the mesh's other dimensions."""
    facts = DeviceFacts(
        target.device_type,
        target.world_size,
        bf16=target.bf16,
        fp8=target.fp8,
        what_if=target.what_if,
        mesh=target.mesh,
    )
    grid = build_grid(recipe, facts, device, probe.num_blocks)
    scoring = _score_grid(recipe, probe, target, grid, cost, correction, rank_traces)
    # A step that cannot run at the smallest micro-batch size (a BatchNorm at one row) fails every trace:
    # that size is excluded with the cause and the larger ones are scored.
    for _ in range(MICRO_SIZE_RETRIES):
        smallest = scoring.evaluation.rows[0]
        larger = tuple(c for c in grid.candidates if _rows(c, probe.seq_len) > smallest)
        if scoring.scored or scoring.untraceable is None or not larger:
            break
        why = (
            f"batch.micro_size={smallest}",
            f"the step cannot run at {smallest} row{'s' if smallest > 1 else ''}: {scoring.untraceable}",
        )
        grid = replace(grid, candidates=larger, excluded=(*grid.excluded, why))
        scoring = _score_grid(recipe, probe, target, grid, cost, correction, rank_traces)
    return scoring


def _rows(plan: Plan, seq_len: int) -> int:
    """The rows of `plan`'s micro-batch (a token budget rounded up to whole rows)."""
    return -(-plan.micro_batching.tokens(seq_len) // seq_len)


def _score_grid(
    recipe: Recipe,
    probe: ModelProbe,
    target: Target,
    grid: Grid,
    cost: CostModel | None,
    correction: Callable[[Prediction], Prediction] | None,
    rank_traces: bool,
) -> Scoring:
    evaluation = Evaluation(recipe, probe, target, cost or CostModel.for_device(target.device_type), grid)
    if rank_traces:  # per rank: the trainer's step, traced
        evaluation.traces = RankTraces(probe.spec, probe.progress)
        evaluation.traces.trace(grid.candidates)
    excluded = list(grid.excluded)
    scored: list[Scored] = []
    untraceable: Unsupported | None = None
    for candidate in grid.candidates:
        try:
            found = evaluation.score(candidate)
            if correction is not None:
                found = replace(found, prediction=correction(found.prediction))
            scored.append(found)
        except HostMemoryExceeded as exc:
            reason = (f"strategies.sharding_offload={candidate.sharding.offload}", str(exc))
            if reason not in excluded:
                excluded.append(reason)
        except Unsupported as exc:  # the trace of this precision and mode failed
            untraceable = untraceable or exc
            loss = f" and loss={candidate.loss.name}" if candidate.loss.name != "standard" else ""
            reason = (
                f"strategies.precision={candidate.precision.name} with "
                f"checkpointing={candidate.checkpointing.describe()}{loss}",
                str(exc),
            )
            if reason not in excluded:
                excluded.append(reason)
    return Scoring(grid, evaluation, scored, excluded, untraceable)


def _with_reserved(
    scored: list[Scored], evaluation: Evaluation, model: ReservedModel, usable: int
) -> list[Scored]:
    """Reserved bytes (reserved.py) for the plans whose peak fits, fastest first, until the chosen plan
    and its runners-up fit by them; the plans after those keep the peak alone (not replayed: a replay
    of a deep model costs a fraction of a second, and a search has hundreds of candidates)."""
    out, fitting = [], 0
    for found in sorted(scored, key=Scored.order):
        if fitting <= RUNNERS_UP and found.prediction.peak <= usable and not found.prediction.lower_bound:
            found = evaluation.with_reserved(found, model)
            fitting += not found.short(usable)
        out.append(found)
    return out


class Evaluation:
    """Scores candidates, sharing traces (in the probe), walks and model-state levels between them."""

    def __init__(
        self, recipe: Recipe, probe: ModelProbe, target: Target, cost: CostModel, grid: Grid
    ) -> None:
        self.recipe, self.probe, self.target, self.cost = recipe, probe, target, cost
        self.candidates = grid.candidates
        seq = probe.seq_len
        sizes = sorted({_rows(c, seq) for c in grid.candidates}) or [1]
        self.rows = (sizes[0], sizes[-1])  # the traced micro-batch sizes: the ends of the range
        per_rank = per_rank_batch(recipe, target.shape.dp_size)
        self.host = probe.spec.host_bytes() if target.device_type == "cpu" else 0  # host memory is the device
        self.fixed = probe.buffer_bytes + probe.step_data_bytes(per_rank) + self.host
        self.workload = Workload(
            numel=probe.shape.numel,
            block_numel=sum(p.numel for p in probe.shape.params if p.block is not None),
            num_blocks=probe.num_blocks,
            hidden=probe.hidden_size,
            head_numel=probe.head_numel,
            trained_tensors=len(probe.shape.trainable.params),
            reference_forwards=probe.spec.reference_forwards,
            grad_clip=recipe.train.grad_clip,
            seq_len=seq,
            rows_per_step=per_rank,
            world_size=target.shape.dp_size,
        )
        self.walks: dict[tuple[Any, ...], StepWalk] = {}
        self.states: dict[tuple[Any, ...], StateLevels] = {}
        self.kept: dict[tuple[Any, ...], tuple[float, float]] = {}
        self.traces: RankTraces | None = None  # on a mesh: each candidate's traced rank

    def score(self, plan: Plan) -> Scored:
        probe, target = self.probe, self.target
        seq = probe.seq_len
        tokens, micro_steps = plan.micro_batching.tokens(seq), plan.micro_batching.micro_steps(seq)
        levels = self._levels(plan, micro_steps)
        if target.host_bytes is not None and levels.host + levels.paged > target.host_bytes:
            raise HostMemoryExceeded(
                f"strategies.sharding_offload: {plan.sharding.describe()} with optimizer_states="
                f"{plan.update_states.describe()} keeps {(levels.host + levels.paged) / 2**30:.2f} GiB per rank "
                f"in host memory, more than the {target.host_bytes / 2**30:.2f} GiB usable (host_memory_bytes of "
                "the --gpu profile)"
            )
        offloaded = 0
        traced = self._traced(plan)
        if traced is not None or predict(levels, STATES_ONLY).peak > target.budget.usable:
            walk = STATES_ONLY  # traced per rank, or the model states alone do not fit: no walk needed
        else:
            weights = _weights_dtype(plan)
            traces = _traces(probe, plan, target, self.rows_of(plan), weights)
            replicated = plan.sharding.replicated
            in_backward = plan.optimizer_step.in_backward
            key = (
                plan.precision,
                plan.checkpointing,
                plan.loss,
                tokens,
                micro_steps > 1,
                replicated,
                weights,
                plan.update_states if in_backward else None,
            )
            if key not in self.walks:
                modes = (
                    (plan.checkpointing,) * probe.num_blocks
                    if _traced_as_itself(probe, plan.checkpointing, target.device_type)
                    else plan.checkpointing.block_modes(probe.num_blocks, target.device_type)
                )
                if in_backward:
                    foreach = target.device_type == "cuda"
                    added = in_backward_memory.in_flight(
                        probe.shape, plan.precision, plan.update_states, foreach
                    )
                    traces = in_backward_memory.traces(traces, added, tokens)
                self.walks[key] = step_walk(traces, modes, tokens, micro_steps, replicated)
            walk = self.walks[key]
            if plan.checkpointing.offloads_activations:
                offloaded = probe.num_blocks * _kept_per_block(traces[NoCheckpointing()], tokens)
        step = self.cost.step(
            self.workload,
            plan,
            micro_tokens=tokens,
            micro_steps=micro_steps,
            # what the optimizer streams (the same bytes when it steps in backward: the standard levels)
            state_bytes=_streamed(self._levels(plan.replace(optimizer_step=OptimizerStep()), micro_steps)),
            offloaded_activation_bytes=offloaded,
            device_type=target.device_type,
            host_bytes=levels.host,
        )
        if traced is not None:
            return Scored(plan, traced, step, levels, "rank trace")
        return Scored(
            plan, predict(levels, walk), step, levels, "trace" if self.traces is None else "formula"
        )

    def _traced(self, plan: Plan) -> Prediction | None:
        """`plan`'s rank trace on the target's mesh, or None (no mesh, or it could not be traced: why is in
        the progress lines, `RankTraces.trace`; activations offloaded to the host are walked from traces)."""
        if self.traces is None or plan.checkpointing.offloads_activations:
            return None
        try:
            return self.traces.get(plan).prediction(self.host)
        except Unsupported:
            return None

    def block_activations(self, plan: Plan) -> tuple[float, float]:
        """(activations one block keeps for backward, the rest of the activations at the peak) for one
        micro-step of `plan`, from walks of its traces at the model's depth and one block less: a pipeline
        stage holds a different number of blocks' worth (mesh_cost.py)."""
        probe = self.probe
        tokens = plan.micro_batching.tokens(probe.seq_len)
        key = (
            plan.precision,
            plan.checkpointing,
            plan.loss,
            tokens,
            plan.sharding.replicated,
            _weights_dtype(plan),
        )
        if key not in self.kept:
            self.kept[key] = self._block_activations(plan, tokens)
        return self.kept[key]

    def _block_activations(self, plan: Plan, tokens: int) -> tuple[float, float]:
        probe, target = self.probe, self.target
        traces = _traces(probe, plan, target, self.rows_of(plan), _weights_dtype(plan))
        modes = plan.checkpointing.block_modes(probe.num_blocks, target.device_type)
        if _traced_as_itself(probe, plan.checkpointing, target.device_type):
            modes = (plan.checkpointing,) * probe.num_blocks
        replicated = plan.sharding.replicated

        def activations(depth: int) -> float:
            walked = step_walk(traces, modes[:depth], tokens, 1, replicated).first
            return float(walked.at_peak[ACTIVATIONS])

        whole = activations(len(modes))
        if len(modes) < 3:
            return whole / max(len(modes), 1), 0.0
        kept = max(0.0, whole - activations(len(modes) - 1))
        return kept, max(0.0, whole - kept * len(modes))

    def with_reserved(self, found: Scored, model: ReservedModel) -> Scored:
        """`found` with its reserved bytes, from the traces its score walked (cached: no new trace)."""
        plan, seq = found.plan, self.probe.seq_len
        traces = _traces(self.probe, plan, self.target, self.rows_of(plan), _weights_dtype(plan))
        if plan.checkpointing.offloads_activations:  # the device keeps what a recomputed block keeps
            traces = {m: t for m, t in traces.items() if m != NoCheckpointing()}
        tokens, accumulated = plan.micro_batching.tokens(seq), plan.micro_batching.micro_steps(seq) > 1
        prediction = model.apply(found.prediction, traces, tokens, accumulated, plan.sharding.replicated)
        return replace(found, prediction=prediction)

    def rows_of(self, plan: Plan) -> tuple[int, int]:
        """The traced sizes `plan`'s fit is drawn through (`ModelProbe.fit_rows`)."""
        return self.probe.fit_rows(self.rows, plan.micro_batching.tokens(self.probe.seq_len))

    def full_fine_tuning(self, plan: Plan) -> tuple[int, int, int] | None:
        """What `plan` would keep between steps training every parameter of an unquantised base (what the
        adapters save), or None for a plan without adapters."""
        if plan.adapters.name == "none" and plan.quantization.name == "none":
            return None
        shape = self.probe.shape
        full = ModelShape(
            tuple(
                replace(p, trainable=not plan.adapters.owns(p.name))
                for p in shape.params
                if not plan.adapters.owns(p.name)
            ),
            shape.num_blocks,
        )
        levels = state_levels(
            full,
            precision=plan.precision,
            optimizer_states=plan.update_states,
            backend=plan.sharding.build(plan.precision, plan.micro_batch_size, plan.accumulation_steps),
            replicated=plan.sharding.replicated,
            world_size=self._state_ranks(plan),
            dim0=self.probe.dim0,
            fixed_bytes=0,
            foreach=False,
        )
        return levels.stored

    def _state_ranks(self, plan: Plan) -> int:
        """The ranks the plan's sharding divides model states over on the target's mesh."""
        return self.target.shape.state_ranks(plan.sharding.gradient_sync == "reduce-scatter")

    def _levels(self, plan: Plan, micro_steps: int) -> StateLevels:
        key = (
            plan.precision,
            plan.update_states,
            plan.sharding,
            micro_steps > 1,
            plan.quantization,
            plan.optimizer_step,
        )
        if key not in self.states:  # the sharding arithmetic visits every rank: once per key
            no_grad = self.probe.no_grad(plan.precision, self.rows, lambda: self._first_size(plan))
            self.states[key] = self._levels_with(plan, micro_steps, no_grad)
        return self.states[key]

    def _levels_with(self, plan: Plan, micro_steps: int, no_grad: frozenset[str]) -> StateLevels:
        backend = plan.sharding.build(plan.precision, plan.micro_batch_size, micro_steps)
        levels = state_levels(
            self.probe.shape,
            precision=plan.precision,
            optimizer_states=plan.update_states,
            backend=backend,
            replicated=plan.sharding.replicated,
            world_size=self._state_ranks(plan),
            dim0=self.probe.dim0,
            fixed_bytes=self.fixed,
            foreach=self.target.device_type == "cuda",
            quantization=plan.quantization,
            linear_weights=self.probe.linear_weights,
            no_grad=no_grad,
        )
        if plan.optimizer_step.in_backward:
            levels = in_backward_memory.levels(levels, self.probe.shape, plan.update_states)
        return _with_frozen(levels, self.probe.spec.frozen_bytes, plan)

    def _first_size(self, scored: Plan) -> None:
        """One traced size of the first fit a plan is walked with (`_traces`), alone: what `ModelProbe.
        no_grad` reads before any other trace. The plan is the grid's first whose model states fit even with
        a gradient for every parameter (an upper bound: it is walked, so the size is one its fit reuses),
        else `scored`."""
        usable, seq = self.target.budget.usable, self.probe.seq_len
        plan = next(
            (
                c
                for c in self.candidates
                if predict(
                    self._levels_with(c, c.micro_batching.micro_steps(seq), frozenset()), STATES_ONLY
                ).peak
                <= usable
            ),
            scored,
        )
        probe, device_type = self.probe, self.target.device_type
        mode = plan.checkpointing
        if not _traced_as_itself(probe, mode, device_type):
            mode = mode.traced_modes(device_type)[0]
        capability = self.target.compute_capability if device_type == "cuda" else None
        precision, weights = _traced_precision(probe, plan), _weights_dtype(plan)
        probe.first_size(precision, mode, self.rows_of(plan), weights, plan.loss, capability, plan.compile)


def _with_frozen(levels: StateLevels, frozen_bytes: Callable[[torch.dtype], int], plan: Plan) -> StateLevels:
    """`levels` with the frozen weights the trainer keeps beside the model (`ModelSpec.frozen_bytes`, in the
    plan's compute dtype) added to the weights, at every moment and between steps."""
    precision = plan.precision
    frozen = frozen_bytes(precision.autocast_dtype or precision.stored_dtype)
    if not frozen:
        return levels
    weights, gradients, states = levels.stored
    return replace(levels, weights=levels.weights + frozen, stored=(weights + frozen, gradients, states))


def _streamed(levels: StateLevels) -> int:
    """The bytes an optimizer step reads and writes: a sharded plan's stored states, not its transient
    gathered weights and unsharded gradient copies."""
    if levels.replicated:  # paged states are streamed too, wherever the driver keeps them
        return levels.weights + levels.optimizer_gradients + levels.optimizer_states + levels.paged
    return sum(levels.stored)


def _traces(
    probe: ModelProbe, plan: Plan, target: Target, rows: tuple[int, int], weights_dtype: torch.dtype | None
) -> Traces:
    """The fits `plan` is walked with; on a CUDA target attention is traced as its GPU's kernel runs it."""
    mode, device_type = plan.checkpointing, target.device_type
    capability = target.compute_capability if device_type == "cuda" else None
    precision = _traced_precision(probe, plan)
    if _traced_as_itself(probe, mode, device_type):
        return {mode: probe.trace(precision, mode, rows, weights_dtype, plan.loss, capability, plan.compile)}
    traces = {
        m: probe.trace(precision, m, rows, weights_dtype, plan.loss, capability, plan.compile)
        for m in mode.traced_modes(device_type)
    }
    if mode.offloads_activations and device_type == "cuda":
        traces[mode] = offload_trace(traces[NoCheckpointing()], traces[FullCheckpointing()])
    depth = min(trace.depth for trace in traces.values())
    edges = edge_pattern(mode.block_modes(probe.num_blocks, device_type), depth)
    if edges is not None:  # blocks of mixed modes: the segments outside them (memory_model.EdgePattern)
        traces[edges] = probe.trace(
            precision, edges, rows, weights_dtype, plan.loss, capability, plan.compile
        )
    return traces


def _traced_precision(probe: ModelProbe, plan: Plan) -> Precision:
    """The precision `plan`'s model is traced in: frozen parameters as its sharding stores them
    (`Sharding.as_stored`: an autocast copy of an fp32 frozen weight is what a matmul's backward keeps,
    none of a bf16 one); a model without frozen parameters traces alike either way (one trace)."""
    if probe.shape.trainable_numel == probe.shape.numel:
        return plan.precision
    return plan.sharding.as_stored(plan.precision)


def _attention(probe: ModelProbe, plan: Plan, target: Target, rows: tuple[int, int]) -> str:
    """Which attention the chosen plan's traces ran (cached traces: no new trace)."""
    traces = _traces(probe, plan, target, rows, _weights_dtype(plan))
    return next((t.attention for t in traces.values() if t.attention), "")


def _traced_as_itself(probe: ModelProbe, mode: Checkpointing, device_type: str) -> bool:
    """A model traced without block segments (its blocks run several times per forward: model_probe.py)
    holds each phase whole, so a mode that mixes modes per block (`fraction`) cannot be walked from the
    traces of its parts: it is traced as itself over the whole model, which is exact. (Until the first
    trace finds the blocks re-entered, the walk takes the higher of the parts: memory_model.walk.)"""
    return (
        not probe.block_segments
        and not mode.offloads_activations
        and len(set(mode.block_modes(probe.num_blocks, device_type))) > 1
    )


def _weights_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype the forward reads weights in when the sharding hands it gathered bf16 weights."""
    return torch.bfloat16 if plan.sharding.hands_bf16_weights(plan.precision) else None


def _kept_per_block(trace: FittedTrace, tokens: int) -> int:
    middle = 1 if trace.depth > 2 else 0
    return int(trace.at(SegmentKey("first", "fwd.block", middle), tokens).end[ACTIVATIONS])
