"""The planner's rank trace of a mesh (planner/rank_trace.py) against the tracker of the same rank in a real
gloo run: HSDP 2 x 2, FSDP 2 x TP 2, TP 2 with and without sequence parallel, pipelines of 2 stages (GPipe
and 1F1B, and 1F1B x FSDP 2), in fp32 and bf16-mixed, with and without full recompute. Acceptance (issue
25): the predicted per-rank peak within 3% of the measured, never under by more than 0.5%. The measured side is every rank's tracked peak of the last of 2 steps
(`mesh_jobs.py`, as `memtrain profile` reports them); the prediction is the busiest traced rank's, plus the
host data a CPU run counts, as the search scores it. Full-length rows: the planner predicts the longest
rows, and variable-length ones would make every plan an over-prediction of the run.

What the fake process group does not hold and a gloo run does, the trace holds for a CPU target
(`memtrain.memory.gloo_buffers`): gloo's copy of each reduce-scatter's input (the HSDP bf16 step without
recompute peaks during FSDP2's gradient reduce-scatter: 7% under before), an asynchronous (tensor-parallel)
collective's or an all-gather's tensors until this rank's next collective (gloo's worker thread lets go of
them a while after the wait returns: TP's all-reduce of the lm_head's input gradient was alive at the final
norm's backward in some runs, 1% under there, and FSDP2's all-gather at the first stage's steady-phase forward
under 1F1B x FSDP in one run of two, 2.7% under there; the trace holds them always, so the prediction covers
both timings), and a pipeline send's tensor while the schedule keeps its work. The traced model is the
planner's (no causal mask, grouped-query keys and values unexpanded, as in the run: GPipe was 3.4% over
before), and the real batch a CPU run's tracker counts is counted (4.2 KB under before). Measured errors
per case: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.distributed import DistEnv
from memtrain.plan import Plan, mesh_of, pinned_plan
from memtrain.planner import plan_here
from memtrain.planner.rank_trace import RankTraces, traced_ranks
from memtrain.training.class_reference import class_reference

from helpers import tiny_recipe_dict

sys.path.insert(0, str(Path(__file__).parent))
from mesh_jobs import launch  # noqa: E402

UNDER, OVER = -0.005, 0.03
# a case whose run peaks in one of two gloo timings, the trace holding the higher always: its measured
# spread. 1F1B x FSDP 2 in fp32: the first stage's steady-phase forward with a backward's all-gather still
# held by gloo (337,284 B measured, 337,420 predicted), or without it (316,940 B; in-process trace without
# gloo's buffers 316,052 + the batch): +6.5% over there. Before the tracker released the layers FSDP2 frees
# by resizing their storages (memory/storage_resize.py), the lower timing counted 11 KB of them (328,172 B).
OVER_TIMED = {"pp_x_dp_1f1b_fp32_none": 0.07}


class Compared(NamedTuple):
    """One case: the busiest traced rank's predicted peak and the busiest rank's measured one, and the
    pipeline stages of those ranks."""

    predicted: int
    measured: int
    predicted_stage: int
    measured_stage: int


DATA = {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 8, "min_len": 16}}
CASES = {  # name -> (ranks, mesh, precision, checkpointing)
    "hsdp_fp32_full": (4, {"dp_replicate": 2, "dp_shard": 2}, "fp32", "full"),
    "hsdp_bf16_none": (4, {"dp_replicate": 2, "dp_shard": 2}, "bf16-mixed", "none"),
    "hsdp_bf16_full": (4, {"dp_replicate": 2, "dp_shard": 2}, "bf16-mixed", "full"),
    "fsdp_x_tp_fp32_none": (4, {"dp_shard": 2, "tp": 2}, "fp32", "none"),
    "fsdp_x_tp_bf16_full": (4, {"dp_shard": 2, "tp": 2}, "bf16-mixed", "full"),
    "pp_x_dp_1f1b_fp32_none": (4, {"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b"}, "fp32", "none"),
    "tp_sp_fp32_none": (2, {"tp": 2}, "fp32", "none"),
    "tp_sp_bf16_full": (2, {"tp": 2}, "bf16-mixed", "full"),
    "tp_no_sp_fp32_full": (2, {"tp": 2, "sequence_parallel": False}, "fp32", "full"),
    "tp_no_sp_bf16_none": (2, {"tp": 2, "sequence_parallel": False}, "bf16-mixed", "none"),
    "pp_gpipe_fp32_none": (2, {"pp": 2, "pp_schedule": "gpipe"}, "fp32", "none"),
    "pp_gpipe_bf16_none": (2, {"pp": 2, "pp_schedule": "gpipe"}, "bf16-mixed", "none"),
    "pp_1f1b_fp32_full": (2, {"pp": 2, "pp_schedule": "1f1b"}, "fp32", "full"),
    "pp_1f1b_bf16_full": (2, {"pp": 2, "pp_schedule": "1f1b"}, "bf16-mixed", "full"),
}


def _sections(mesh: dict[str, Any], precision: str, checkpointing: str) -> dict[str, Any]:
    sharded = "dp_shard" in mesh or "dp_replicate" in mesh or "pp" in mesh  # pipeline stages save through DCP
    return {
        "strategies": {
            "precision": precision,
            "checkpointing": checkpointing,
            "sharding": "zero3" if sharded else "none",
            "mesh": mesh,
        },
        "batch": {"global_size": 8, "micro_size": 2},
        "train": {"steps": 2},
        "data": DATA,
    }


def _plan(recipe: CausalLMRecipe, ranks: int) -> Plan:
    mesh = mesh_of(recipe, ranks)
    return pinned_plan(recipe, DistEnv(0, ranks, 0, torch.device("cpu"), mesh=mesh)).replace(mesh=mesh)


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Compared]:
    """Case -> the predicted peak of its busiest traced rank and the measured peak of its busiest rank."""
    tmp = tmp_path_factory.mktemp("rank_trace")
    out: dict[str, Compared] = {}
    for ranks in (4, 2):
        names = [n for n, case in CASES.items() if case[0] == ranks]
        jobs = []
        for name in names:
            sections = {**_sections(*CASES[name][1:]), "memory": {"track": True}}
            jobs.append({"run_dir": str(tmp / name), "sections": sections})
        measured = launch(tmp, ranks, jobs, name="rank_trace")
        recipes = [
            CausalLMRecipe.from_dict(tiny_recipe_dict(tmp / name, **_sections(*CASES[name][1:])))
            for name in names
        ]
        spec = CausalLMTrainer(recipes[0]).model_spec()  # the job; each plan names its own strategies
        traces = RankTraces(spec, progress=lambda _line: None)
        plans = [_plan(recipe, ranks) for recipe in recipes]
        by_ranks: dict[tuple[int, ...], list[Plan]] = {}  # `RankTraces.trace` traces its plans on one set
        for plan in plans:
            by_ranks.setdefault(tuple(traced_ranks(plan.shape)), []).append(plan)
        for some in by_ranks.values():
            traces.trace(some)
        for name, plan, result in zip(names, plans, measured, strict=True):
            trace = traces.get(plan)
            peaks = [sum(rank["tracked"].values()) for rank in result["ranks"]]
            busiest = max(range(ranks), key=peaks.__getitem__)
            stages = [plan.shape.coordinates(rank)["pp"] for rank in (trace.rank, busiest)]
            out[name] = Compared(trace.prediction(spec.host_bytes()).peak, peaks[busiest], *stages)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_rank_trace_predicts_the_busiest_ranks_peak(name: str, compared: dict[str, Compared]) -> None:
    """Within 3% of the tracker's peak of the same step, never under by more than 0.5%. The hole it closes:
    on a mesh the search divided states by the shard group and kept activations whole (an over-prediction
    of everything tensor parallelism splits), and nothing checked a mesh's prediction against a run. HSDP bf16
    without recompute was 7% under before the trace held gloo's buffers (gloo's copy of the reduce-scatter input
    at the peak), and TP in bf16 1% under in the runs where gloo's thread kept the last all-reduce's output
    alive past the peak (now held in every trace); the pipelines were 3.4% over (GPipe, fp32: the trace's model
    built a causal mask) and 2.7% under (1F1B x FSDP, in runs where an all-gather's buffers outlived its
    wait)."""
    predicted, measured = compared[name].predicted, compared[name].measured
    error = (predicted - measured) / measured
    assert UNDER <= error <= OVER_TIMED.get(name, OVER), (name, predicted, measured, f"{error:+.2%}")


def test_the_search_scores_a_pinned_mesh_by_the_rank_trace(tmp_path: Path) -> None:
    """`plan_here` on a recipe pinning FSDP 2 x TP 2 for 4 ranks, with the trainer built on this one process
    (the hole: `Trainer.__init__` arranged the mesh over its own world of 1 and refused it): the chosen plan
    is scored by the rank trace, and predicts less than the formula would (it divides what TP splits)."""
    raw = tiny_recipe_dict(tmp_path, **_sections({"dp_shard": 2, "tp": 2}, "fp32", "none"))
    recipe = CausalLMRecipe.from_dict(raw)
    spec = CausalLMTrainer(recipe).model_spec()
    result = plan_here(recipe, spec, world_size=4)
    assert result.chosen is not None and result.chosen.predicted_by == "rank trace"
    assert result.chosen.prediction.where.startswith("rank 0: ")
    formula = plan_here(recipe, spec.__class__(**{**vars(spec), "rebuild": None}), world_size=4)
    assert formula.chosen is not None and formula.chosen.predicted_by == "formula"
    assert result.chosen.prediction.peak < formula.chosen.prediction.peak


def test_each_pipeline_stage_is_traced_on_its_first_rank(compared: dict[str, Compared]) -> None:
    """One traced rank per pipeline stage (the first of each), the plan's prediction the busiest of them,
    which is on the run's busiest stage (here the last: the logits and the loss on top of its micro-batches
    in flight), except under 1F1B x FSDP: its first stage is the busiest in the runs where gloo still holds
    a backward's all-gather at the next forward (one run of two), which the trace holds always, so it
    predicts the first stage there and the run's busiest is either. The hole: a pipeline could not run under the fake process group (its stages sent their
    tensors' shapes as pickled objects, which that group cannot carry), so its plans kept the formula; its
    stages are now built with those shapes (`strategies.pipeline`) and traced as every other mesh."""
    from memtrain.mesh import MeshShape

    assert traced_ranks(MeshShape(pp=2, dp_shard=2)) == [0, 2]
    assert traced_ranks(MeshShape(dp_replicate=2, dp_shard=2, tp=2)) == [0]
    staged = {name: compared[name] for name in CASES if "pp" in CASES[name][1]}
    timed = staged.pop("pp_x_dp_1f1b_fp32_none")
    assert {(c.predicted_stage, c.measured_stage) for c in staged.values()} == {(1, 1)}, staged
    assert timed.predicted_stage == 0, timed


def test_a_trainer_class_is_named_for_another_process() -> None:
    """`--trainer` reads what `class_reference` writes; a class defined in a function has no name there."""

    class Local(CausalLMTrainer):
        pass

    assert class_reference(CausalLMTrainer) == "memtrain.causal_lm.trainer:CausalLMTrainer"
    assert class_reference(Local) is None
