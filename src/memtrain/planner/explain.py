"""What the planner decided, for a person (a table) and for a program (`--json`).

Why both the runners-up and the cheapest plan that does not fit: a plan alone does not say how close the
run is to the edge, what the next choices would cost, or what more memory would buy; those three answer
"why this plan" and "what would I have to change". When nothing fits, the same table is the error, with
the recipe keys that would open more of the search.
"""

from __future__ import annotations

from typing import Any

from memtrain.memory import format_bytes
from memtrain.memory.footprint import COMPONENTS
from memtrain.memory.headroom import MemoryBudget
from memtrain.plan import Plan
from memtrain.planner.result import PlanResult, Scored
from memtrain.recipe import Recipe

RUNNERS_UP = 5
GiB = 2**30


def to_json(result: PlanResult) -> dict[str, Any]:
    """The `memtrain plan --json` document (bytes as integers)."""
    plan = result.plan
    usable = result.budget.usable if result.budget is not None else 0
    return {
        "plan": plan.to_dict(),
        "summary": plan.summary(),
        "predicted": result.predicted.to_dict() if result.predicted is not None else None,
        "model_states": dict(
            zip(("weights", "gradients", "optimizer_states"), result.chosen.states.stored, strict=True)
        )
        if result.chosen is not None
        else None,
        "budget": result.budget.to_dict() if result.budget is not None else None,
        "full_fine_tuning": dict(
            zip(("weights", "gradients", "optimizer_states"), result.full_fine_tuning, strict=True)
        )
        if result.full_fine_tuning is not None
        else None,
        "candidates": [s.to_dict(usable) for s in (*result.ranked, *result.infeasible)],
        "cheapest_infeasible": result.cheapest_infeasible.to_dict(usable)
        if result.cheapest_infeasible
        else None,
    }


def describe(result: PlanResult, title: str) -> str:
    """The plan table: budget, the chosen plan by component, the next five, the cheapest misfit."""
    chosen, budget = result.chosen, result.budget
    assert chosen is not None and budget is not None, "describe() needs a plan the planner chose"
    lines = [title, _budget_line(budget)]
    peak = chosen.prediction.peak
    sharding = result.plan.sharding
    lines += [
        "",
        f"chosen: {_label(chosen.plan)}   sharding backend {sharding.backend}, offload {sharding.offload}",
    ]
    at_peak = chosen.prediction.at_peak
    lines.append("  " + "  ".join(f"{c} {_gib(getattr(at_peak, c))}" for c in COMPONENTS))
    usable = budget.usable
    lines.append(
        f"  peak {_gib(peak)} of {_gib(usable)} usable ({100 * peak / max(usable, 1):.0f}%), at "
        f"{chosen.prediction.where}; predicted step {chosen.cost.total:.3g} s"
    )
    stored = dict(zip(("weights", "gradients", "optimizer states"), chosen.states.stored, strict=True))
    lines.append("  kept between steps: " + ", ".join(f"{k} {_gib(v)}" for k, v in stored.items()))
    if result.full_fine_tuning is not None:
        full = dict(zip(stored, result.full_fine_tuning, strict=True))
        saved = sum(full.values()) - sum(stored.values())
        plan = result.plan
        label = ", ".join(k.describe() for k in (plan.quantization, plan.adapters) if k.name != "none")
        lines.append(
            "  full fine-tuning would keep: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in full.items())
            + f" ({_gib(saved)} more than {label})"
        )
    lines += ["", *table([*result.ranked[: 1 + RUNNERS_UP]], usable)]
    if len(result.ranked) > 1 + RUNNERS_UP:
        lines.append(f"  ... {len(result.ranked) - 1 - RUNNERS_UP} more plans fit")
    misfit = result.cheapest_infeasible
    if misfit is not None:
        bound = "at least " if misfit.prediction.lower_bound else ""
        lines += [
            "",
            f"fastest plan that does not fit: {_label(misfit.plan)}: peak {bound}"
            f"{_gib(misfit.prediction.peak)}, {_gib(misfit.short(usable))} short, step {misfit.cost.total:.3g} s",
        ]
    lines += _excluded(result.excluded)
    return "\n".join(lines)


def explain_failure(
    recipe: Recipe,
    budget: MemoryBudget,
    infeasible: tuple[Scored, ...],
    excluded: tuple[tuple[str, str], ...],
) -> str:
    """The `PlanError` message: nothing fits, the closest plans, and which recipe keys to change."""
    lines = ["no plan fits the memory budget", _budget_line(budget)]
    if infeasible:
        closest = sorted(infeasible, key=lambda s: (s.prediction.lower_bound, s.prediction.peak, s.order()))
        best = closest[0]
        bound = "at least " if best.prediction.lower_bound else ""
        lines += [
            "",
            f"closest: {_label(best.plan)} needs {bound}{_gib(best.prediction.peak)} "
            f"({_gib(best.short(budget.usable))} short); peak at {best.prediction.where}",
            "  " + "  ".join(f"{c} {_gib(getattr(best.prediction.at_peak, c))}" for c in COMPONENTS),
            "",
            *table(closest[: 1 + RUNNERS_UP], budget.usable),
        ]
    lines += _excluded(excluded)
    lines += ["", "to make a plan fit, change one of:", *(f"  - {s}" for s in suggestions(recipe))]
    return "\n".join(lines)


def suggestions(recipe: Recipe) -> list[str]:
    """Recipe keys that would widen the search or shrink the step, most effective first."""
    s = recipe.strategies
    out = []
    if s.checkpointing != "auto":
        out.append(f"strategies.checkpointing=auto (now {s.checkpointing}): recompute activations")
    if recipe.batch.micro_size != "auto":
        out.append(
            f"batch.micro_size=auto (now {recipe.batch.micro_size}): smaller micro-batches, same global batch"
        )
    if s.optimizer_states != "auto":
        out.append(
            f"strategies.optimizer_states=auto (now {s.optimizer_states}): bf16 or 8-bit optimizer states"
        )
    if s.sharding != "auto":
        out.append(f"strategies.sharding=auto (now {s.sharding}): shard states over ranks (zero1/2/3)")
    if s.precision != "auto" and "bf16-master" not in s.precision:
        out.append("strategies.precision: allow bf16-master (bf16 weights and gradients, fp32 master copy)")
    out += [
        f"data.seq_len (now {recipe.data.seq_len}): shorter sequences",
        "more ranks (torchrun --nproc_per_node / --nnodes) with zero3, or a GPU with more memory",
        "memory.budget (the simulated budget, on CPU)",
    ]
    return out


def table(rows: list[Scored], usable: int) -> list[str]:
    header = (
        f"  {'#':>2}  {'precision':<11} {'checkpointing':<15} {'optimizer':<10} {'sharding':<8} "
        f"{'micro x acc':<11} {'peak':>11} {'fits':<4} {'step s':>8}"
    )
    body = []
    for index, s in enumerate(rows, 1):
        c = s.plan.summary()
        body.append(
            f"  {index:>2}  {c['precision']:<11} {c['checkpointing']:<15} {c['optimizer_states']:<10} "
            f"{c['sharding']:<8} {c['micro_batching']:<11} "
            f"{('>' if s.prediction.lower_bound else '') + _gib(s.prediction.peak):>11} "
            f"{'yes' if not s.short(usable) else 'no':<4} {s.cost.total:>8.3g}"
        )
    return [header, *body]


def _budget_line(b: MemoryBudget) -> str:
    return (
        f"budget per rank: total {_gib(b.total)}, free {_gib(b.free)}, reserve {_gib(b.reserve)}, "
        f"usable {_gib(b.usable)} ({b.source})"
    )


def _excluded(excluded: tuple[tuple[str, str], ...]) -> list[str]:
    return ["", "excluded:", *(f"  {what}: {why}" for what, why in excluded)] if excluded else []


def _label(plan: Plan) -> str:
    fields = plan.summary()
    return (
        f"precision={fields['precision']} checkpointing={fields['checkpointing']} "
        f"optimizer_states={fields['optimizer_states']} sharding={fields['sharding']} "
        f"micro_batch={fields['micro_batch_size']} x {fields['accumulation_steps']} accumulation"
    )


def _gib(n: int) -> str:
    return format_bytes(n) if abs(n) < GiB else f"{n / GiB:.2f} GiB"
