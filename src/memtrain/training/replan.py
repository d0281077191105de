"""Re-planning during a run: when the run measures more memory than its plan predicted, switch to a
stronger plan and go on with the same batch, as long as any plan the running trainer can switch to fits.

Why: a prediction a few percent low is enough to run out of memory in step 1 under a tight budget, and
shrinking the micro-batch alone cannot help at one row per micro-batch, although more checkpointing or a
chunked loss would fit. So the measured excess corrects *every* candidate's prediction, not only the
current one, and the search runs again over the plans the live trainer can switch to in place.

The correction (`Correction`): activations times `activation_ratio`, plus `rest_bytes` on the rest. From
a tracker report (the first steps' calibration) both come from the components at the peak; from an
out-of-memory error (no report: the step died) the real peak is known only to be above the budget, so the
whole excess is put on the activations, which is where a step's prediction can be wrong (model states are
arithmetic). Corrections compose (a later excess is measured against an already corrected prediction) and
only ever raise predictions, so a plan that failed stays excluded and repeated out-of-memory errors end,
at the latest when no plan is left (`PlanError` naming what to change).

What can switch in place, between two attempts of a step: the micro-batching (the gradient does not change:
the loss is normalised by the global token count), the checkpointing of the blocks (wrappers removed and
re-applied: `strategies.apply.switch_in_place`) and the loss (re-bound). Everything else stays:
- optimizer-state format: converting fp32 AdamW moments to bf16 or 8-bit needs a new optimizer of another
  class (and, with sharding, another wrapper) loaded with converted states; a safe conversion exists for
  no sharding at most, and it would change the numerics of the rest of the run. Not switched: a recipe
  that needs smaller states must say so (strategies.optimizer_states) at the start.
- precision, sharding, adapters and quantisation change the stored weights or their layout;
- compile (`strategies.compile`): kept as the run started; when the checkpointing switches, the compiled
  blocks (or model) are compiled again over the new wrappers (`switch_in_place`).
- the optimizer step (one optimizer, or one per parameter stepped in backward, built at setup). Stepped in
  backward, a step cannot accumulate: its micro-batch stays, and a pinned plan cannot shrink it.
Only options the recipe allows are considered (a pinned strategies.checkpointing stays pinned); the
micro-batch may go down from a pinned batch.micro_size, as out-of-memory recovery always did.

Every rank makes the same choice: the excess is agreed (maximum over ranks), rank 0 searches and
broadcasts, every rank checks the plan digest (`planner.search_for_run`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memtrain.distributed import DistEnv
from memtrain.errors import PlanError
from memtrain.memory import MemoryTracker, StepMemory, format_bytes
from memtrain.memory.footprint import Footprint
from memtrain.memory.headroom import MemoryBudget, Target
from memtrain.plan import Plan, per_rank_batch
from memtrain.planner import ModelSpec, PlanResult, search_for_run
from memtrain.planner.memory_model import Prediction
from memtrain.recipe import Recipe
from memtrain.strategies.micro_batching import TokenBudget

SWITCHABLE = ("checkpointing", "loss")  # recipe kinds a run may change in place (and the micro-batching)


@dataclass(frozen=True)
class Correction:
    """A measured excess over predictions: activations x `activation_ratio`, plus `rest_bytes`."""

    activation_ratio: float = 1.0
    rest_bytes: int = 0

    def __call__(self, prediction: Prediction) -> Prediction:
        """The peak moment's activations grow by (ratio - 1) x the most activations of *any* moment, so
        that a moment just below the peak (a forward under an optimizer-step peak) cannot overtake it."""
        at = prediction.at_peak
        more = math.ceil((self.activation_ratio - 1.0) * prediction.maxima.activations)
        corrected = at.with_(activations=max(0, at.activations + more), other=at.other + self.rest_bytes)
        return dataclasses.replace(prediction, at_peak=corrected)

    def then(self, later: Correction) -> Correction:
        """This correction followed by `later` (measured against predictions this one corrected)."""
        return Correction(self.activation_ratio * later.activation_ratio, self.rest_bytes + later.rest_bytes)

    def describe(self) -> str:
        return f"activations x{self.activation_ratio:.3f}, +{format_bytes(self.rest_bytes)}"

    def to_dict(self) -> dict[str, float]:
        return {"activation_ratio": self.activation_ratio, "rest_bytes": self.rest_bytes}


def excess(predicted: Footprint, measured: StepMemory | int | None, budget: MemoryBudget) -> Correction:
    """What `measured` says beyond `predicted` (the current plan's prediction): a tracker report (per
    component), a measured peak alone, or None for an out-of-memory error (the peak passed `budget.free`)."""
    if isinstance(measured, StepMemory):
        peak = measured.peak_bytes
        if peak <= predicted.peak:
            return Correction()
        activations = measured.at_peak.get("activations", 0)
        ratio = activations / predicted.activations if activations > predicted.activations > 0 else 1.0
        rest = max(0, (peak - activations) - (predicted.peak - predicted.activations))
        found = Correction(ratio, rest)
        short = peak - _corrected_peak(predicted, found)
        return Correction(ratio, rest + max(0, short))  # the components' moments may differ: cover the peak
    peak = measured if measured is not None else budget.free + 1
    if peak <= predicted.peak:
        return Correction()
    if predicted.activations == 0:
        return Correction(1.0, peak - predicted.peak)
    on_activations = Correction((peak - (predicted.peak - predicted.activations)) / predicted.activations)
    rounding = max(0, peak - _corrected_peak(predicted, on_activations))
    return Correction(on_activations.activation_ratio, rounding)


def agree(correction: Correction, env: DistEnv) -> Correction:
    """The largest correction over ranks (each rank measured its own peak)."""
    if not env.distributed:
        return correction
    import torch.distributed as dist

    values = torch.tensor(
        [correction.activation_ratio, float(correction.rest_bytes)], dtype=torch.float64, device=env.device
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return Correction(float(values[0]), int(values[1]))


@dataclass(frozen=True)
class Replanned:
    result: PlanResult  # the new plan with its corrected prediction
    record: dict[str, Any]  # for plan.json's "replans"
    line: str  # what changed, for the log


def replan(
    recipe: Recipe,
    env: DistEnv,
    spec: ModelSpec,
    current: PlanResult,
    plan: Plan,
    correction: Correction,
    step: int,
    reason: str,
    tracker: MemoryTracker | None,
) -> Replanned:
    """The fastest plan the running trainer can switch to that fits `current.budget` under `correction`
    (`PlanError` naming what to change when none does). Collective on several ranks."""
    assert current.budget is not None
    target = _target(env, current.budget)
    cap = (
        recipe.batch.micro_size
        if isinstance(recipe.batch.micro_size, int)
        else per_rank_batch(recipe, env.dp_size)
    )
    found: PlanResult | None = None
    failure = ""
    with _paused(tracker):  # tracing allocates host tensors that are not the run's
        for variant in _switchable_recipes(recipe, plan):
            try:
                result = search_for_run(variant, env, spec, target, correction=correction)
            except PlanError as exc:
                failure = str(exc).splitlines()[0]
                continue
            fitting = [s for s in result.ranked if s.plan.micro_batch_size <= cap]
            if fitting:
                found = dataclasses.replace(
                    result, chosen=fitting[0], plan=fitting[0].plan, ranked=tuple(fitting)
                )
                break
    if found is None:
        raise PlanError(_nothing_fits(recipe, plan, step, reason, correction, current.budget, failure))
    assert found.chosen is not None
    changed = _changes(plan, found.plan)
    record = {
        "step": step + 1,
        "reason": reason,
        "from": plan.summary(),
        "to": found.plan.summary(),
        "correction": correction.to_dict(),
        "predicted_peak": found.chosen.prediction.peak,
        "usable": current.budget.usable,
    }
    line = (
        f"[memtrain] {reason} at step {step + 1}: re-planned ({changed}; predictions corrected: "
        f"{correction.describe()}, now {format_bytes(found.chosen.prediction.peak)} of "
        f"{format_bytes(current.budget.usable)} usable)"
    )
    return Replanned(found, record, line)


def smaller_micro_batch(plan: Plan, step: int, reason: str) -> tuple[Plan, str]:
    """A pinned plan (no prediction to correct): the same plan with smaller micro-batches, and the log line."""
    current, smaller = plan.micro_batching, plan.micro_batching.smaller()
    if plan.optimizer_step.in_backward:
        raise PlanError(
            f"{reason} at step {step + 1}: smaller micro-batches would accumulate gradients, which "
            "strategies.optimizer_step: in_backward cannot (it steps on each micro-step's gradient); resume "
            "(--resume) with strategies.checkpointing: full, or strategies.optimizer_step: standard"
        )
    if smaller is None:
        unit = "token" if plan.micro_batch_tokens is not None else "sequence"
        raise PlanError(
            f"out of memory at step {step + 1} even with one {unit} per micro-batch; enable "
            "strategies.checkpointing (full), lower data.seq_len, or add memory (strategies.sharding)"
        )
    line = (
        f"[memtrain] {reason} at step {step + 1} with micro-batches of {current.describe()}: "
        f"re-planned to {smaller.describe()}"
    )
    return plan.replace(micro_batching=smaller), line


def _switchable_recipes(recipe: Recipe, plan: Plan) -> Iterator[Recipe]:
    """The recipe with every kind but the switchable ones pinned to `plan`'s choice: for sequences one
    recipe with every micro-batch size; for a token budget, the budget and then each halving of it."""
    strategies = recipe.strategies.model_copy(
        update={
            "precision": plan.precision.name,
            "sharding": plan.sharding.name,
            "optimizer_states": plan.optimizer_states.name,
            "optimizer_step": plan.optimizer_step.name,  # its optimizer is built: one per parameter or not
            "compile": plan.compile.name,  # kept; a switch of checkpointing re-compiles (`switch_in_place`)
        }
    )
    optimizer = recipe.optimizer.model_copy(update={"name": plan.optimizer.name})  # it changes the training
    recipe = recipe.model_copy(update={"optimizer": optimizer})
    micro: Any = plan.micro_batching
    if not isinstance(micro, TokenBudget):
        batch = recipe.batch.model_copy(update={"micro_size": "auto"})
        yield recipe.model_copy(update={"strategies": strategies, "batch": batch})
        return
    while micro is not None:
        batch = recipe.batch.model_copy(update={"micro_tokens": micro.max_tokens})
        yield recipe.model_copy(update={"strategies": strategies, "batch": batch})
        micro = micro.smaller()


def _target(env: DistEnv, budget: MemoryBudget) -> Target:
    """The target the run was planned for: this device, with the budget measured before step 1."""
    cuda = env.device.type == "cuda"
    bf16 = torch.cuda.is_bf16_supported() if cuda else True
    fp8 = cuda and torch.cuda.get_device_capability(env.device) >= (8, 9)
    return Target(env.device.type, env.world_size, budget, bf16=bf16, fp8=fp8, mesh=env.mesh)


@contextlib.contextmanager
def _paused(tracker: MemoryTracker | None) -> Iterator[None]:
    if tracker is None:
        yield
        return
    tracker.__exit__(None, None, None)
    try:
        yield
    finally:
        tracker.__enter__()


def _changes(old: Plan, new: Plan) -> str:
    before, after = old.summary(), new.summary()
    kinds = ("checkpointing", "loss", "micro_batching")
    parts = [f"{k.replace('_', ' ')} {before[k]} -> {after[k]}" for k in kinds if before[k] != after[k]]
    return ", ".join(parts) or "the same plan"


def _corrected_peak(predicted: Footprint, correction: Correction) -> int:
    return (
        math.ceil(predicted.activations * correction.activation_ratio)
        + (predicted.peak - predicted.activations)
        + correction.rest_bytes
    )


def _nothing_fits(
    recipe: Recipe,
    plan: Plan,
    step: int,
    reason: str,
    correction: Correction,
    budget: MemoryBudget,
    failure: str,
) -> str:
    pinned = [
        k
        for k in SWITCHABLE
        if isinstance(getattr(recipe.strategies, k), str) and getattr(recipe.strategies, k) != "auto"
    ]
    allow = f"let the run switch {', '.join(f'strategies.{k}' for k in pinned)} (auto), or " if pinned else ""
    return (
        f"{reason} at step {step + 1}: no plan this run can switch to fits the usable "
        f"{format_bytes(budget.usable)} once predictions are corrected by what was measured "
        f"({correction.describe()}); {failure.rstrip('.;:')}. Running: {plan.describe()}. To fit, "
        f"{allow}restart with less to keep: strategies.optimizer_states (bf16 or 8bit), a lower "
        "data.seq_len or batch.global_size, more ranks with strategies.sharding, or a larger memory.budget"
    )
