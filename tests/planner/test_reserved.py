"""Reserved memory in the planner: the traced allocation sequence at the real depth, the search holding
plans to their reserved bytes on a CUDA target, and `memtrain plan`'s table and JSON."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from memtrain.errors import PlanError
from memtrain.memory.caching_allocator import replay
from memtrain.memory.headroom import Target, budget_from
from memtrain.planner.activations import trace_step
from memtrain.planner.allocation_trace import PieceKey, fit_allocations, whole_depth
from memtrain.planner.explain import EXPANDABLE, describe, explain_failure, to_json
from memtrain.planner.prediction_error import MARGIN_FLOOR, measured_error
from memtrain.planner.result import PlanResult, expandable_choice
from memtrain.planner.search import search
from memtrain.strategies.checkpointing import Checkpointing, FullCheckpointing, NoCheckpointing
from memtrain.strategies.precision import PRECISION, Precision

from helpers import probe_of
from planner_cases import MODEL, UNBOUNDED, planner_recipe

PINNED = {"precision": "fp32", "checkpointing": "full", "optimizer_states": "fp32", "loss": "standard"}

pytestmark = pytest.mark.usefixtures("one_thread")


def gpu(usable: int) -> Target:
    budget = budget_from(usable, usable, 0, 0.0, "test")
    return Target("cuda", 1, budget, bf16=True, fp8=False, what_if=True, compute_capability=(9, 0))


def plan(tmp_path: Path, usable: int, **batch: object) -> PlanResult:
    recipe = planner_recipe(tmp_path, strategies=PINNED, batch={"micro_size": 8, **batch})
    return search(recipe, probe_of(recipe), gpu(usable), torch.device("cpu"))


def test_clone_sequence_at_depth_replays_like_the_whole_model(tmp_path: Path) -> None:
    # A 4-block model traced whole and as its 3-block clone: the clone's sequence synthesized at 4 blocks
    # (its middle block twice) is the whole model's, event for event in size, so both replay alike in both
    # allocator modes.
    spec = probe_of(planner_recipe(tmp_path, model={"config": {**MODEL, "num_hidden_layers": 4}})).spec
    assert spec.build_clone is not None
    clone = spec.build_clone
    builds = ((lambda: clone(3)), spec.build_model)
    traces = [
        trace_step(build, spec.blocks, spec.micro_batch, spec.loss, Precision(), FullCheckpointing(), 1)
        for build in builds
    ]
    assert [t.depth for t in traces] == [3, 4]
    # the gradients logged: one per parameter, made once (the later micro-step accumulates in place)
    real = traces[1]
    grads = [
        n for _, events in real.allocations for sid, n in events if n and sid in real.gradient_allocations
    ]
    with torch.device("meta"):
        assert sorted(grads) == sorted(4 * p.numel() for p in spec.build_model().parameters())
    sharded = fit_allocations(real.allocations, 1, real.allocations, 2, real.gradient_allocations).at(
        1, False
    )
    for (_, kept), (_, freed) in zip(real.allocations, sharded, strict=True):  # each freed where it is made
        made = [sid for sid, n in kept if n and sid in real.gradient_allocations]
        assert list(freed) == [*kept, *((sid, 0) for sid in made)]
    made = [whole_depth(t.allocations, 4, t.depth, steps=2) for t in traces]
    assert [m.unmatched for m in made] == [0, 0]
    assert [n for _, n in made[0].events] == [n for _, n in made[1].events]
    for expandable in (False, True):
        synthesized, real = (replay(m.events, expandable_segments=expandable) for m in made)
        assert (synthesized.allocated_peak, synthesized.reserved_peak) == (
            real.allocated_peak,
            real.reserved_peak,
        )
        assert real.reserved_peak >= real.allocated_peak


def test_cuda_plans_carry_reserved_bytes(tmp_path: Path) -> None:
    result = plan(tmp_path, UNBOUNDED)
    assert result.chosen is not None and result.expandable_segments is False
    p = result.chosen.prediction
    assert p.reserved is not None and p.reserved_expandable is not None
    assert p.reserved >= p.peak and p.reserved_expandable >= p.peak
    margin = measured_error().margin  # planner.reserved_margin's default: the measured under-prediction
    assert margin >= MARGIN_FLOOR and p.margin == margin
    assert p.required == p.reserved + int(p.reserved * margin)


def test_plan_whose_allocated_fits_but_reserved_does_not_is_rejected(tmp_path: Path) -> None:
    p = plan(tmp_path, UNBOUNDED).chosen.prediction  # type: ignore[union-attr]
    assert p.reserved is not None and p.peak < p.required
    assert plan(tmp_path, p.required).chosen is not None  # just fits
    with pytest.raises(PlanError, match="no plan fits") as failure:
        plan(tmp_path, (p.peak + p.required) // 2)
    assert "reserved" in str(failure.value)


def test_expandable_segments_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    result = plan(tmp_path, UNBOUNDED)
    assert result.expandable_segments is True and result.with_expandable is None
    p = result.chosen.prediction  # type: ignore[union-attr]
    assert p.reserved == p.reserved_expandable


def test_table_and_json_show_allocated_and_reserved(tmp_path: Path) -> None:
    result = plan(tmp_path, UNBOUNDED)
    assert result.chosen is not None
    p = result.chosen.prediction
    text = describe(result, "plan")
    assert re.search(r" peak +reserved fits ", text)  # the table's columns
    assert f"allocated, {p.reserved / 2**20:.2f} MiB reserved (+{100 * p.margin:.1f}% margin" in text
    document = to_json(result)
    assert document["allocator"] == {"expandable_segments": False, "reserved_margin": measured_error().margin}
    first = document["candidates"][0]
    assert (first["predicted_peak"], first["predicted_reserved"]) == (p.peak, p.reserved)
    assert first["predicted_reserved_expandable_segments"] == p.reserved_expandable
    assert document["with_expandable_segments"] is None


def test_a_faster_plan_that_fits_only_with_expandable_segments_is_suggested(tmp_path: Path) -> None:
    result = plan(tmp_path, UNBOUNDED)
    assert result.chosen is not None and result.budget is not None
    chosen = result.chosen
    usable = chosen.prediction.required
    # a faster candidate whose reserved bytes fit only as expandable segments would lay them out
    faster = dataclasses.replace(
        chosen,
        prediction=dataclasses.replace(
            chosen.prediction, reserved=2 * usable, reserved_expandable=chosen.prediction.peak
        ),
        cost=dataclasses.replace(chosen.cost, compute=chosen.cost.compute / 2),
    )
    assert faster.order() < chosen.order() and faster.short(usable) and faster.fits_expandable(usable)
    assert expandable_choice((faster,), usable, chosen) is faster
    assert expandable_choice((faster,), usable, faster) is None  # not faster than itself
    shown = dataclasses.replace(result, infeasible=(faster,), with_expandable=faster)
    text = describe(shown, "plan")
    assert f"with {EXPANDABLE} a faster plan fits" in text
    assert to_json(shown)["with_expandable_segments"]["predicted_reserved_expandable_segments"] == (
        chosen.prediction.peak
    )
    # nothing fits as the allocator runs now: the first advice is the setting
    budget = dataclasses.replace(result.budget, usable=usable)
    message = explain_failure(planner_recipe(tmp_path), budget, (faster,), ())
    advice = message.split("to make a plan fit, change one of:\n")[1].splitlines()
    assert advice[0].startswith(f"  - with {EXPANDABLE} a plan fits: ")


def test_allocation_sizes_are_fitted_between_the_two_traces() -> None:
    key = PieceKey("first", "fwd.block", 0)
    small = ((key, ((1, 100), (2, 512), (1, 0))),)
    large = ((key, ((1, 300), (2, 512), (1, 0))),)
    fit = fit_allocations(small, 10, large, 30, frozenset())
    assert fit.at(20) == ((key, ((1, 200), (2, 512), (1, 0))),)  # a + b * tokens; a constant stays
    other = ((key, ((1, 300), (3, 64), (3, 0), (1, 0))),)  # another op sequence: the larger trace's sizes
    assert fit_allocations(small, 10, other, 30, frozenset()).at(20) == other
    freed = ((key, ((1, 300), (2, 512), (2, 0))),)  # frees another storage: differs too
    assert fit_allocations(small, 10, freed, 30, frozenset()).at(20) == freed


def test_pieces_after_one_that_differs_are_still_fitted() -> None:
    # A loss cut in chunks of fixed tokens: the larger trace's head makes more chunks (storages 2 and 3
    # against 2), so every later storage has another serial there; the blocks' pieces are fitted as a
    # line all the same (the hole: one differing piece sent every piece to the larger trace's sizes), the
    # head keeps the larger trace's sizes, and a free of a head storage in a later piece is still matched.
    block, head = PieceKey("first", "fwd.block", 0), PieceKey("first", "fwd.head")
    back = PieceKey("first", "bwd.block", 0)
    small = ((block, ((1, 100),)), (head, ((2, 64),)), (back, ((3, 10), (3, 0), (2, 0), (1, 0))))
    large = ((block, ((1, 300),)), (head, ((2, 64), (3, 64))), (back, ((4, 30), (4, 0), (2, 0), (1, 0))))
    fitted = fit_allocations(small, 10, large, 30, frozenset()).at(20)
    assert fitted == (
        (block, ((1, 200),)),
        (head, ((2, 64), (3, 64))),
        (back, ((4, 20), (4, 0), (2, 0), (1, 0))),
    )
    moved = ((block, ((1, 300),)), (head, ((2, 64), (3, 64))), (back, ((4, 30), (4, 0), (1, 0), (2, 0))))
    assert fit_allocations(small, 10, moved, 30, frozenset()).at(20)[2] == moved[2]  # frees in another order


@pytest.mark.parametrize("checkpointing", [NoCheckpointing(), FullCheckpointing()], ids=["none", "full"])
def test_two_traces_of_one_step_log_the_same_sequence(tmp_path: Path, checkpointing: Checkpointing) -> None:
    # bf16-mixed: the autocast cache frees its casts together at the end of the forward, in an order that
    # follows their addresses; the log orders them by age, so the traces at 1 and 3 rows are one sequence
    # and their sizes fit as a line (the hole: they differed in most runs and the reserved model fell back
    # to the larger trace's sizes at every micro-batch size).
    spec = probe_of(planner_recipe(tmp_path)).spec
    traces = [
        trace_step(
            spec.build_model,
            spec.blocks,
            spec.micro_batch,
            spec.loss,
            PRECISION.create("bf16-mixed"),
            checkpointing,
            rows,
        )
        for rows in (1, 3)
    ]
    small, large = (
        [(key, [(sid, n > 0) for sid, n in events]) for key, events in t.allocations] for t in traces
    )
    assert small == large
