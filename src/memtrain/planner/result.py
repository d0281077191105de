"""What a search returns: each candidate scored (`Scored`), and the plan chosen with its runners-up
(`PlanResult`), which `explain` turns into the table and the JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memtrain.memory.footprint import Footprint
from memtrain.memory.headroom import MemoryBudget
from memtrain.plan import Plan
from memtrain.planner.cost import StepCost
from memtrain.planner.memory_model import Prediction, StateLevels


@dataclass(frozen=True)
class Scored:
    """A candidate plan with its predicted peak and step time."""

    plan: Plan
    prediction: Prediction
    cost: StepCost
    states: StateLevels
    predicted_by: str = (
        "trace"  # "rank trace" on a mesh (planner/rank_trace.py), or "formula" where it could not
    )

    def short(self, usable: int) -> int:
        """Bytes over `usable` (0 when it fits): the peak's, or the reserved bytes' with their margin."""
        return max(0, self.prediction.required - usable)

    def fits_expandable(self, usable: int) -> bool:
        """Whether it would fit with expandable segments (False when its reserved bytes were not replayed)."""
        needed = self.prediction.required_expandable
        return needed is not None and needed <= usable

    def order(self) -> tuple[Any, ...]:
        """Faster first; then smaller; then the plan's strategies, so that the order is total."""
        # equal time and memory: eager before compiled (no compile time, no compile to go wrong)
        return (round(self.cost.total, 12), self.prediction.peak, self.plan.compile.compiled, self.plan.key())

    def to_dict(self, usable: int) -> dict[str, Any]:
        return {
            **self.plan.summary(),
            "predicted_peak": self.prediction.peak,
            "predicted_peak_is_lower_bound": self.prediction.lower_bound,
            "predicted_by": self.predicted_by,
            "predicted_reserved": self.prediction.reserved,
            "predicted_reserved_expandable_segments": self.prediction.reserved_expandable,
            "predicted_step_seconds": self.cost.total,
            "fits": self.short(usable) == 0,
            "short_bytes": self.short(usable),
        }


def rank(scored: Sequence[Scored], usable: int) -> tuple[tuple[Scored, ...], tuple[Scored, ...]]:
    """(the plans that fit in `usable` bytes, those that do not), each fastest first."""
    fits = tuple(sorted((s for s in scored if not s.short(usable)), key=Scored.order))
    misfits = tuple(sorted((s for s in scored if s.short(usable)), key=Scored.order))
    return fits, misfits


def expandable_choice(
    infeasible: Sequence[Scored], usable: int, chosen: Scored | None = None
) -> Scored | None:
    """The fastest plan that does not fit as the allocator runs now but would with expandable segments,
    when it is faster than `chosen` (or nothing fits); None otherwise."""
    found = next((s for s in sorted(infeasible, key=Scored.order) if s.fits_expandable(usable)), None)
    if found is None or (chosen is not None and found.order() >= chosen.order()):
        return None
    return found


@dataclass(frozen=True)
class PlanResult:
    """The plan a run trains with and, when the planner chose it, what it predicted and why."""

    plan: Plan
    budget: MemoryBudget | None = None
    chosen: Scored | None = None
    ranked: tuple[Scored, ...] = ()  # plans that fit, fastest first (the chosen one first)
    infeasible: tuple[Scored, ...] = ()  # plans that do not fit, fastest first
    excluded: tuple[tuple[str, str], ...] = ()  # (option, why it cannot run here)
    full_fine_tuning: tuple[int, int, int] | None = None  # the chosen plan's stored states without adapters
    attention: str = ""  # what the chosen plan's activation trace ran for attention (attention_kernels.py)
    expandable_segments: bool | None = None  # the allocator mode planned for (None: no CUDA allocator)
    with_expandable: Scored | None = None  # a faster plan that fits only with expandable segments

    @property
    def predicted(self) -> Footprint | None:
        return self.chosen.prediction.at_peak if self.chosen is not None else None

    @property
    def cheapest_infeasible(self) -> Scored | None:
        return self.infeasible[0] if self.infeasible else None
