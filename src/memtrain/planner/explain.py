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
from memtrain.planner import rules
from memtrain.planner.result import PlanResult, Scored, expandable_choice
from memtrain.recipe import Recipe

RUNNERS_UP = 5
GiB = 2**30
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def to_json(result: PlanResult) -> dict[str, Any]:
    """The `memtrain plan --json` document (bytes as integers). On a CUDA target a candidate's
    `predicted_reserved` is null when it was not replayed (a plan after the chosen one and its runners-up,
    or one whose peak alone does not fit): its `fits` is by its peak."""
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
        "attention": result.attention or None,
        "full_fine_tuning": dict(
            zip(("weights", "gradients", "optimizer_states"), result.full_fine_tuning, strict=True)
        )
        if result.full_fine_tuning is not None
        else None,
        "candidates": [s.to_dict(usable) for s in (*result.ranked, *result.infeasible)],
        "cheapest_infeasible": result.cheapest_infeasible.to_dict(usable)
        if result.cheapest_infeasible
        else None,
        "allocator": {
            "expandable_segments": result.expandable_segments,
            "reserved_margin": result.chosen.prediction.margin if result.chosen is not None else None,
        }
        if result.expandable_segments is not None
        else None,
        "with_expandable_segments": result.with_expandable.to_dict(usable)
        if result.with_expandable
        else None,
        "excluded": [{"option": option, "reason": reason} for option, reason in result.excluded],
    }


def describe(result: PlanResult, title: str) -> str:
    """The plan table: budget, the chosen plan by component, the next five, the cheapest misfit."""
    chosen, budget = result.chosen, result.budget
    assert chosen is not None and budget is not None, "describe() needs a plan the planner chose"
    lines = [title, budget_line(budget)]
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
        f"  peak {_gib(peak)}{_reserved(chosen)} of {_gib(usable)} usable "
        f"({100 * chosen.prediction.required / max(usable, 1):.0f}%), at "
        f"{chosen.prediction.where}; predicted step {chosen.cost.total:.3g} s"
    )
    stored = dict(zip(("weights", "gradients", "optimizer states"), chosen.states.stored, strict=True))
    lines.append("  kept between steps: " + ", ".join(f"{k} {_gib(v)}" for k, v in stored.items()))
    if result.attention:
        lines.append(f"  attention in the trace: {result.attention}")
    if result.full_fine_tuning is not None:
        full = dict(zip(stored, result.full_fine_tuning, strict=True))
        saved = sum(full.values()) - sum(stored.values())
        plan = result.plan
        label = ", ".join(k.describe() for k in (plan.quantization, plan.adapters) if k.name != "none")
        lines.append(
            "  full fine-tuning would keep: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in full.items())
            + f" ({_gib(abs(saved))} {'more' if saved >= 0 else 'less'} than {label})"
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
            f"{_gib(misfit.prediction.peak)}{_reserved(misfit)}, {_gib(misfit.short(usable))} short, "
            f"step {misfit.cost.total:.3g} s",
        ]
    if result.with_expandable is not None:
        lines += ["", _expandable_advice(result.with_expandable, usable, "faster ")]
    lines += _excluded(result.excluded)
    return "\n".join(lines)


def _reserved(s: Scored) -> str:
    """`, X reserved (+m% margin)` where the allocator was replayed."""
    p = s.prediction
    if p.reserved is None:
        return ""
    return f" allocated, {_gib(p.reserved)} reserved (+{100 * p.margin:.1f}% margin: {_gib(p.required)})"


def _expandable_advice(s: Scored, usable: int, kind: str = "") -> str:
    p = s.prediction
    assert p.reserved_expandable is not None
    return (
        f"with {EXPANDABLE} a {kind}plan fits: {_label(s.plan)}: reserved {_gib(p.reserved_expandable)} "
        f"(now {_gib(p.reserved or p.peak)}, {_gib(s.short(usable))} short), step {s.cost.total:.3g} s"
    )


def explain_failure(
    recipe: Recipe,
    budget: MemoryBudget,
    infeasible: tuple[Scored, ...],
    excluded: tuple[tuple[str, str], ...],
    *,
    ruled_out: bool = False,
) -> str:
    """The `PlanError` message: nothing fits, the closest plans, and which recipe keys to change. When
    the rules excluded every candidate (`ruled_out`: none was predicted), memory is not the cause: the
    message leads with the exclusions and names their keys, without memory advice."""
    if ruled_out and excluded:
        first = "; ".join(rules.ruled_out(excluded))
        return "\n".join(
            [
                f"no plan fits: the recipe's choices exclude every candidate (not memory): {first}",
                budget_line(budget),
                *_excluded(excluded),
                "",
                "to make a plan run, change one of the excluded choices above (`memtrain validate` reports them)",
            ]
        )
    lines = ["no plan fits the memory budget", budget_line(budget)]
    if infeasible:
        closest = sorted(infeasible, key=lambda s: (s.prediction.lower_bound, s.prediction.peak, s.order()))
        best = closest[0]
        bound = "at least " if best.prediction.lower_bound else ""
        lines += [
            "",
            f"closest: {_label(best.plan)} needs {bound}{_gib(best.prediction.peak)}{_reserved(best)} "
            f"({_gib(best.short(budget.usable))} short); peak at {best.prediction.where}",
            "  " + "  ".join(f"{c} {_gib(getattr(best.prediction.at_peak, c))}" for c in COMPONENTS),
            "",
            *table(closest[: 1 + RUNNERS_UP], budget.usable),
        ]
    lines += _excluded(excluded)
    advice = suggestions(recipe, budget, infeasible, excluded)
    expandable = expandable_choice(infeasible, budget.usable)
    if expandable is not None:
        advice.insert(0, _expandable_advice(expandable, budget.usable))
    lines += ["", "to make a plan fit, change one of:", *(f"  - {s}" for s in advice)]
    return "\n".join(lines)


def suggestions(
    recipe: Recipe,
    budget: MemoryBudget | None = None,
    infeasible: tuple[Scored, ...] = (),
    excluded: tuple[tuple[str, str], ...] = (),
) -> list[str]:
    """Recipe keys that would widen the search or shrink the step, most effective first. Offload is
    suggested when it could make the closest plan fit: the states it keeps between steps (what offload
    moves to the host) are at least what it is short."""
    s = recipe.strategies
    out = []
    closest = min(
        infeasible, key=lambda c: (c.prediction.lower_bound, c.prediction.peak, c.order()), default=None
    )
    if closest is not None and budget is not None and not _open(s.sharding_offload):
        movable, short = sum(closest.states.stored), closest.short(budget.usable)
        if movable >= short:
            out.append(
                f"strategies.sharding_offload=auto (now {s.sharding_offload}) with strategies.sharding=auto, on a "
                "GPU (even one): keep optimizer states or weights in host memory; the closest plan keeps "
                f"{_gib(movable)} of them on the device and is {_gib(short)} over"
            )
    if any("host memory" in why for _, why in excluded):
        out.append(
            "more host memory per rank (host_memory_bytes in the --gpu profile): offloaded states overflow it"
        )
    sharded_accumulation = any(
        c.plan.accumulation_steps > 1 and not c.plan.sharding.replicated for c in infeasible
    )
    if s.gradient_reduction == "per_step" and sharded_accumulation:
        out.append(
            "strategies.gradient_reduction=auto (now per_step): reduce-scatter every micro-step, so zero2/zero3 "
            "keep no unsharded gradient between micro-steps"
        )
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
    if isinstance(recipe.optimizer.name, str) and recipe.optimizer.name == "adamw":
        out.append(
            "optimizer.name: list lion, adafactor or galore beside adamw (fewer state bytes; a different "
            "training, so the planner takes one only when you list it)"
        )
    if s.sharding != "auto":
        out.append(f"strategies.sharding=auto (now {s.sharding}): shard states over ranks (zero1/2/3)")
    if s.precision != "auto" and "bf16-master" not in s.precision:
        out.append("strategies.precision: allow bf16-master (bf16 weights and gradients, fp32 master copy)")
    if s.optimizer_step != "auto" and "in_backward" not in s.optimizer_step:
        clip = ", and with train.grad_clip two passes a step" if recipe.train.grad_clip else ""
        out.append(
            "strategies.optimizer_step: allow in_backward (each parameter stepped in backward, its gradient "
            f"freed: no gradient memory; one micro-step per step, sharding none{clip})"
        )
    if recipe.sequence_length_key is not None:
        key = recipe.sequence_length_key
        out.append(f"{key} (now {recipe.value_at(key)}): shorter sequences")
    out += [
        "more ranks (torchrun --nproc_per_node / --nnodes) with zero3, or a GPU with more memory",
        "memory.budget (the simulated budget, on CPU)",
    ]
    return out


TABLE_COLUMNS = (  # (header, plan.summary() key) of the strategy columns, in the order they run
    ("precision", "precision"),
    ("checkpointing", "checkpointing"),
    ("loss", "loss"),
    ("optimizer", "optimizer"),
    ("states", "optimizer_states"),
    ("step", "optimizer_step"),
    ("sharding", "sharding"),
)


def table(rows: list[Scored], usable: int) -> list[str]:
    """One line per plan; each strategy column as wide as its longest entry (`zero3(params, ...)`); a
    compile column when a row is compiled (after the loss: where compile is applied)."""
    columns: tuple[tuple[str, str], ...] = TABLE_COLUMNS
    if any(s.plan.compile.compiled for s in rows):
        columns = (*TABLE_COLUMNS[:3], ("compile", "compile"), *TABLE_COLUMNS[3:])
    cells = [[str(s.plan.summary()[key]) for _, key in columns] for s in rows]
    widths = [max([len(title), *(len(row[i]) for row in cells)]) for i, (title, _) in enumerate(columns)]

    def strategies(values: list[str]) -> str:
        return " ".join(f"{v:<{w}}" for v, w in zip(values, widths, strict=True))

    header = (
        f"  {'#':>2}  {strategies([t for t, _ in columns])} "
        f"{'micro x acc':<11} {'peak':>11} {'reserved':>11} {'fits':<4} {'step s':>8}"
    )
    body = []
    for index, (s, row) in enumerate(zip(rows, cells, strict=True), 1):
        body.append(
            f"  {index:>2}  {strategies(row)} {s.plan.summary()['micro_batching']:<11} "
            f"{('>' if s.prediction.lower_bound else '') + _gib(s.prediction.peak):>11} "
            f"{_gib(s.prediction.reserved) if s.prediction.reserved is not None else '-':>11} "
            f"{'yes' if not s.short(usable) else 'no':<4} {s.cost.total:>8.3g}"
        )
    return [header, *body]


def budget_line(b: MemoryBudget) -> str:
    return (
        f"budget per rank: total {_gib(b.total)}, free {_gib(b.free)}, reserve {_gib(b.reserve)}, "
        f"usable {_gib(b.usable)} ({b.source})"
    )


def _excluded(excluded: tuple[tuple[str, str], ...]) -> list[str]:
    return ["", "excluded:", *(f"  {what}: {why}" for what, why in excluded)] if excluded else []


def _label(plan: Plan) -> str:
    fields = plan.summary()
    return (
        f"precision={fields['precision']} checkpointing={fields['checkpointing']} loss={fields['loss']} "
        + (f"optimizer={fields['optimizer']} " if plan.optimizer.name != "adamw" else "")
        + (f"compile={fields['compile']} " if plan.compile.compiled else "")
        + f"optimizer_states={fields['optimizer_states']} optimizer_step={fields['optimizer_step']} "
        f"sharding={fields['sharding']} "
        f"micro_batch={fields['micro_batch_size']} x {fields['accumulation_steps']} accumulation"
    )


def _open(choice: object) -> bool:
    return not isinstance(choice, str) or choice == "auto"


def _gib(n: int) -> str:
    return format_bytes(n) if abs(n) < GiB else f"{n / GiB:.2f} GiB"
