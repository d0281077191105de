"""`MemoryMonitor`: what the loop measures about memory and time, held against what the plan predicted.

Why apart from the loop: measuring a step (the cheap per-step peak, the full tracker's report), comparing
the first steps with the prediction (calibration), timing the plan's first steps against its predicted
step time, and choosing a new plan when memory runs out or passes the budget (`replan`) are one concern
with its own state — the records that end up in plan.json. The loop (`memtrain.training.trainer`) calls
`begin_step` / `end_step` around a step, `after_step` after it, and `replan` when a step ran out of
memory; it applies the plan it gets back to the live model.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from memtrain.distributed import DistEnv, gather_objects
from memtrain.errors import PlanError
from memtrain.memory import MemoryTracker, StepMemory, StepPeak, format_bytes
from memtrain.plan import Plan
from memtrain.planner import ModelSpec, PlanResult, calibration, step_time_calibration
from memtrain.recipe import MemoryConfig, Recipe
from memtrain.run import RunDirectory
from memtrain.strategies.compile import compiled_modules
from memtrain.training import link_timing, replan

CALIBRATION_STEPS = 2  # the first step differs (lazy optimizer state, allocator warm-up): compare two
STEP_TIME_STEPS = 3  # steps after a plan's first whose median time is compared with its predicted step time


@dataclass(frozen=True)
class OverBudget:
    """A calibrated step whose measured peak passed the usable budget: the loop re-plans with this."""

    reason: str
    measured: StepMemory | int | None


class MemoryMonitor:
    """Per-run memory and time measurements, calibration and re-planning (see the module docstring)."""

    def __init__(self, env: DistEnv, run: RunDirectory) -> None:
        self.env = env
        self.run = run
        self.plan_result: PlanResult | None = None  # the planner's result for the plan in use
        self.tracker: MemoryTracker | None = None
        self.step_peak = StepPeak(env.device)
        self.max_step_peak = 0
        self.memory_reports: list[StepMemory] = []
        self.device_peaks: list[int] = []  # the cheap per-step peak, kept beside tracked reports
        self.calibration: list[dict[str, Any]] = []  # the first steps: predicted against measured
        self.step_time: dict[str, Any] | None = None  # rank 0: predicted against measured step time
        self.links: dict[str, Any] | None = None  # rank 0: each mesh dimension's link, timed at the start
        self._step_times: list[float] = []  # rank 0: seconds of the steps timed so far, of `_timed_plan`
        self._timed_plan: PlanResult | None = None
        self.oom_events: list[dict[str, Any]] = []  # out-of-memory errors recovered from, in order
        self.replans: list[dict[str, Any]] = []  # plans switched to during the run (training/replan.py)
        self.correction = replan.Correction()  # what the run measured beyond the predictions, so far
        self.calibrate_until = 0  # the steps before this one compare their measured peak with the plan

    # ------------------------------------------------------------------------------------ measuring

    def measure_links(self, enabled: bool) -> DistEnv:
        """Time each mesh dimension's link before the strategies are applied (training/link_timing.py; a
        collective on several ranks); the run's environment, now holding its `DeviceMesh` on a mesh."""
        self.env, self.links = link_timing.measure_links(self.env, enabled)
        return self.env

    def track(self, model: nn.Module, optimizer: Any, memory: MemoryConfig) -> None:
        """Run the full tracker when the recipe asks for it (`memory.track`, or a simulated budget). Its
        dispatch mode makes dynamo run compiled modules eagerly: said once, so a compiled plan measured by
        the tracker is known to train eager."""
        if memory.track or memory.budget is not None:
            if compiled_modules(model):
                warnings.warn(
                    "memory.track / memory.budget: the tracker's dispatch mode makes torch.compile run the "
                    "compiled modules eagerly, so this run trains and is measured eager; set memory.track: "
                    "false and leave memory.budget unset to train compiled",
                    stacklevel=2,
                )
            self.tracker = MemoryTracker(
                model,
                optimizer,
                budget_bytes=int(memory.budget) if memory.budget is not None else None,
                device=self.env.device,
            )

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.tracker.phase(name) if self.tracker is not None else contextlib.nullcontext()

    def begin_step(self, step: int) -> None:
        """Start measuring step `step` (0-based), or an attempt of it that is redone."""
        self.step_peak.start()
        if self.tracker is not None:
            self.tracker.begin_step(step + 1)

    def end_step(self, row: dict[str, Any]) -> None:
        """Add the step's peak (and the tracker's report) to its metrics row."""
        row["peak_memory_bytes"] = self.step_peak.stop()
        row["oom_recoveries"] = len(self.oom_events)
        row["replans"] = len(self.replans)
        self.max_step_peak = max(self.max_step_peak, row["peak_memory_bytes"])
        if self.tracker is None:
            return
        report = self.tracker.end_step()
        self.memory_reports.append(report)
        self.device_peaks.append(row["peak_memory_bytes"])
        row["tracked"] = {
            "peak_bytes": report.peak_bytes,
            "at_peak": dict(report.at_peak),
            "peak_phase": report.peak_phase,
            "peak_module": report.peak_module,
        }

    def record_oom(self, step: int, micro_step: int, plan: Plan, error: BaseException) -> None:
        self.oom_events.append(
            {
                "step": step + 1,
                "micro_step": micro_step + 1,
                "micro_batch_size": plan.micro_batch_size,
                "error": str(error)[:200],
            }
        )

    def unagreeable_oom(self, step: int, plan: Plan) -> PlanError:
        """The error of a rank that ran out of memory in the last micro-step of a step on several ranks,
        which the ranks cannot agree to redo (see `Trainer._try_accumulate`)."""
        tokens = plan.micro_batch_tokens
        smaller = (
            f"a smaller batch.micro_tokens (it was {tokens})"
            if tokens is not None
            else f"a smaller batch.micro_size (it was {plan.micro_batch_size})"
        )
        return PlanError(
            f"out of memory on rank {self.env.rank} in the last micro-step of step {step + 1}, while the other "
            "ranks were synchronising it: the ranks cannot agree to redo this step (only an earlier micro-step "
            f"can be redone). Continue with --resume and {smaller}"
        )

    # ------------------------------------------------------------------------------------ after a step

    def start_at(self, step: int) -> None:
        """The run (re)starts at `step`: its first steps are calibrated."""
        self.calibrate_until = step + CALIBRATION_STEPS

    def after_step(self, step: int, row: dict[str, Any], plan: Plan, last: bool) -> OverBudget | None:
        """Time the step and calibrate it (a collective while calibrating); an `OverBudget` when the
        measured peak passed the usable budget and the run must re-plan."""
        self._time_step(row, plan, last)
        if step < self.calibrate_until:
            return self._calibrate(step, row, plan)
        return None

    def _calibrate(self, step: int, row: dict[str, Any], plan: Plan) -> OverBudget | None:
        """Compare a first step's measured memory with the plan's prediction and record it in plan.json.

        The measurement is the tracker's report when it runs (all components), else the allocator's
        peak on CUDA; on a CPU without the tracker, RSS is no per-tensor figure and only the budget
        check is skipped. On several ranks each rank's figures are gathered (`_every_rank`) and a rank
        over the budget re-plans every rank."""
        result = self.plan_result
        assert result is not None
        report = self.memory_reports[-1] if self.tracker is not None and self.memory_reports else None
        if report is not None:
            entry = calibration(result, report)
            measured_peak: int | None = report.peak_bytes
        else:
            predicted = result.predicted
            measured_peak = row["peak_memory_bytes"] if self.env.device.type == "cuda" else None
            entry = {
                "predicted": predicted.to_dict() if predicted is not None else None,
                "measured": {"peak": measured_peak} if measured_peak is not None else None,
            }
        budget = result.budget
        over = budget is not None and measured_peak is not None and measured_peak > budget.usable
        everyone = self._every_rank(entry, over)
        if self.env.distributed:
            entry["ranks"] = everyone
            entry["over_ranks"] = [r["coordinates"] for r in everyone if r["over"]]
        self.calibration.append({"step": step + 1, **entry})
        if self.env.is_main:
            self.run.write_plan(self.plan_record(plan))
        over_ranks = [r for r in everyone if r["over"]]
        if not over_ranks:
            return None
        worst = max(over_ranks, key=lambda r: r["measured"]["peak"])
        shape = self.env.shape
        at = ", ".join(f"{d} {c}" for d, c in worst["coordinates"].items() if getattr(shape, d) > 1)
        where = f" on rank {worst['rank']} ({at})" if self.env.distributed else ""
        reason = (
            f"measured peak {format_bytes(worst['measured']['peak'])}{where} passed the "
            f"usable {format_bytes(budget.usable if budget else 0)}"
        )
        return OverBudget(reason, report if report is not None else measured_peak)

    def _every_rank(self, entry: dict[str, Any], over: bool) -> list[dict[str, Any]]:
        """Every rank's measured figures against the prediction, in rank order (a collective on several
        ranks): its mesh coordinates, its measured peak and components, the relative error of the
        prediction (the busiest rank's, traced or by formula: `predicted_where` names it) and whether it
        passed the budget. A mesh's ranks hold different shares, so one rank's figures cannot speak for
        the others."""
        mine = {
            "rank": self.env.rank,
            "coordinates": self.env.shape.coordinates(self.env.rank),
            "measured": entry["measured"],
            "relative_error": entry.get("relative_error"),
            "over": over,
        }
        return [dict(r) for r in gather_objects(mine, self.env) if isinstance(r, dict)]

    def _time_step(self, row: dict[str, Any], plan: Plan, last: bool) -> None:
        """Rank 0: time the plan's first steps after its first (lazy optimizer state, warm-up);
        after `STEP_TIME_STEPS` of them, or at the end of a shorter run, compare their median with the
        predicted step time: a log line, `step_time` in plan.json and summary.json, and a re-fit of this
        machine's step-time model when more than 10% off (planner/step_time_calibration.py). A plan
        switched to (re-plan, out-of-memory recovery) is timed afresh."""
        result = self.plan_result
        if not self.env.is_main or self.step_time is not None or result is None or result.chosen is None:
            return
        if result is not self._timed_plan:  # the first step of this plan, or one a new plan took over
            self._timed_plan, self._step_times = result, []
        else:
            self._step_times.append(row["step_time_s"])
        if self._step_times and (len(self._step_times) >= STEP_TIME_STEPS or last):
            self.step_time = step_time_calibration.check_step_time(
                result.chosen.cost, self._step_times, self.env.device, plan.describe(), plan.compile.compiled
            )
            # stderr, with the planner's progress: `memtrain profile --json` keeps stdout for its report
            print(step_time_calibration.describe(self.step_time), file=sys.stderr, flush=True)
            self.run.write_plan(self.plan_record(plan))

    # ------------------------------------------------------------------------------------ re-planning

    def replan(
        self,
        step: int,
        plan: Plan,
        recipe: Recipe,
        spec: ModelSpec,
        why: OverBudget | None = None,
    ) -> Plan:
        """The plan to go on with after an out-of-memory error (`why` None) or a calibrated step over the
        budget (training/replan.py): the excess measured over the prediction corrects every candidate,
        and the fastest plan the live model can switch to that fits replaces `plan`. A pinned plan
        (nothing predicted) only shrinks its micro-batch."""
        reason = why.reason if why is not None else "out of memory"
        result = self.plan_result
        if result is None or result.chosen is None or result.budget is None:
            new, line = replan.smaller_micro_batch(plan, step, reason)
        else:
            measured = why.measured if why is not None else None
            excess = replan.excess(result.chosen.prediction.at_peak, measured, result.budget)
            self.correction = replan.agree(self.correction.then(excess), self.env)
            done = replan.replan(
                recipe, self.env, spec, result, plan, self.correction, step, reason, self.tracker
            )
            new, self.plan_result, line = done.result.plan, done.result, done.line
            self.replans.append(done.record)
            if self.oom_events and why is None:
                self.oom_events[-1]["replanned_to"] = done.record["to"]
            self.calibrate_until = step + 1 + CALIBRATION_STEPS  # the new plan's first steps are compared too
            if self.env.is_main:
                self.run.write_plan(self.plan_record(new))
        if self.env.is_main:
            print(line + ("; redoing the same batch" if why is None else ""), flush=True)
        return new

    def plan_record(self, plan: Plan) -> dict[str, Any]:
        """plan.json: the plan, its prediction and budget, and what the run measured against them."""
        result = self.plan_result
        return {
            "plan": plan.to_dict(),
            "summary": plan.summary(),
            "predicted": result.predicted.to_dict() if result and result.predicted is not None else None,
            "budget": result.budget.to_dict() if result and result.budget is not None else None,
            "calibration": self.calibration,
            "step_time": self.step_time,
            "links": self.links,
            "replans": self.replans,
        }
