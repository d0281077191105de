"""Re-planning during a run (training/replan.py): a run that measures more than its plan predicted
switches to a stronger plan and goes on with the same batch, as long as any plan it can switch to fits;
otherwise it stops with a `PlanError` that names what to change. And the budget sweep's promise: every
run finishes under its budget or is refused before step 1."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import PlanError
from memtrain.training.trainer import Batch

from helpers import REPO, TINY_LLAMA, inflate_last_report, tiny_recipe

pytestmark = pytest.mark.usefixtures("shared_traces")  # tests/conftest.py: the same tiny jobs planned again

MICRO_ONE = {"global_size": 4, "micro_size": 1}
CHOICE = {"checkpointing": ["none", "full"], "loss": "standard", "optimizer_states": "fp32"}
STEPS = {"steps": 4, "lr": 1e-3}


class InjectedOOM(CausalLMTrainer):
    """Raises an out-of-memory error in `loss` at the chosen (step, call) pairs, or at every call of
    `every_step_from` on (a device far smaller than predicted)."""

    def __init__(
        self,
        *args: Any,
        inject: set[tuple[int, int]] = frozenset(),
        every_step_from: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.inject, self.every_step_from = set(inject), every_step_from
        self.step_now, self.calls = -1, 0

    def train_step(self, step: int) -> dict[str, Any]:
        self.step_now, self.calls = step, 0
        return super().train_step(step)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        if model is not self.model:  # the planner tracing the job: no device to run out of
            return super().loss(model, batch)
        self.calls += 1
        always = self.every_step_from is not None and self.step_now >= self.every_step_from
        if always or (self.step_now, self.calls) in self.inject:
            self.inject.discard((self.step_now, self.calls))
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().loss(model, batch)


def _fitting_budget(tmp_path: Path, batch: dict[str, Any]) -> int:
    """A simulated budget whose usable share just holds the fastest plan of CHOICE (none: nothing
    recomputed), so that a stronger plan fits only after a small correction."""
    trainer = CausalLMTrainer(tiny_recipe(tmp_path / "probe", strategies=CHOICE, batch=batch))
    result = trainer.choose_plan()
    assert result.chosen is not None and result.plan.checkpointing.name == "none"
    return int(result.chosen.prediction.peak / 0.98) + 256


@pytest.fixture(scope="module")
def micro_one_budget(tmp_path_factory: pytest.TempPathFactory) -> int:
    return _fitting_budget(tmp_path_factory.mktemp("budget"), MICRO_ONE)


def test_oom_at_micro_batch_one_replans_to_checkpointing_and_redoes_the_batch(
    tmp_path: Path, micro_one_budget: int
) -> None:
    budget = micro_one_budget
    trainer = InjectedOOM(
        tiny_recipe(
            tmp_path / "oom", memory={"budget": budget}, strategies=CHOICE, batch=MICRO_ONE, train=STEPS
        ),
        inject={(1, 1)},
    )
    losses = trainer.fit().losses

    assert trainer.plan.micro_batch_size == 1 and trainer.plan.checkpointing.name == "full"
    assert (
        len(trainer.monitor.oom_events) == 1
        and trainer.monitor.oom_events[0]["replanned_to"]["checkpointing"] == "full"
    )
    assert [r["step"] for r in trainer.monitor.replans] == [2]
    assert (
        trainer.monitor.correction.activation_ratio > 1.0
    )  # the none plan's corrected prediction passed the budget
    assert all(r.peak_bytes <= budget for r in trainer.monitor.memory_reports)
    # The same losses as a run pinned to the stronger plan (recompute is exact in fp32), all 4 steps.
    pinned = {**CHOICE, "checkpointing": "full"}
    reference = CausalLMTrainer(
        tiny_recipe(tmp_path / "ref", strategies=pinned, batch=MICRO_ONE, train=STEPS)
    )
    expected = reference.fit().losses
    assert len(losses) == 4 and losses == pytest.approx(expected, abs=1e-6)
    for (name, value), (_, mine) in zip(
        reference.model.named_parameters(), trainer.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(mine, value, atol=1e-6, rtol=0, msg=name)


class InflatedFirstStep(CausalLMTrainer):
    """Step 1's tracked report shows more activations than the step really had, enough to pass the usable
    budget (1% over it, still under the device budget): a prediction that was low, seen by the first
    step's calibration (not an out-of-memory error)."""

    def train_step(self, step: int) -> dict[str, Any]:
        row = super().train_step(step)
        if step == 0:
            inflate_last_report(self)
        return row


def test_a_measured_excess_corrects_every_candidate_not_only_smaller_micro_batches(tmp_path: Path) -> None:
    batch = {"global_size": 8, "micro_size": "auto"}
    budget = _fitting_budget(tmp_path, batch)
    trainer = InflatedFirstStep(
        tiny_recipe(tmp_path / "run", memory={"budget": budget}, strategies=CHOICE, batch=batch, train=STEPS)
    )
    trainer.setup()
    before = trainer.plan_result
    assert before is not None and before.plan.checkpointing.name == "none"
    raw = {s.plan: s.prediction.peak for s in (*before.ranked, *before.infeasible)}
    result = trainer.fit()

    assert len(result.losses) == 4 and not trainer.monitor.oom_events
    (record,) = trainer.monitor.replans
    assert record["step"] == 1 and "measured peak" in record["reason"]
    # Old recovery would have halved the micro-batch (8 -> 4) with nothing recomputed; with every candidate
    # corrected, recomputing the blocks at the larger micro-batch is faster and fits.
    assert trainer.plan.checkpointing.name == "full"
    assert trainer.plan.micro_batch_size > before.plan.micro_batching.smaller().size
    after = trainer.plan_result
    assert after is not None and after.chosen is not None
    assert all(s.prediction.peak > raw[s.plan] for s in after.ranked)  # corrected, not only the old plan
    assert after.chosen.prediction.peak <= after.budget.usable
    assert all(r.peak_bytes <= budget for r in trainer.monitor.memory_reports)


def test_nothing_switchable_fits_is_a_plan_error_naming_what_to_change(
    tmp_path: Path, micro_one_budget: int
) -> None:
    budget = micro_one_budget
    trainer = InjectedOOM(
        tiny_recipe(
            tmp_path / "oom", memory={"budget": budget}, strategies=CHOICE, batch=MICRO_ONE, train=STEPS
        ),
        every_step_from=1,
    )
    with pytest.raises(PlanError) as raised:
        trainer.fit()
    message = str(raised.value)
    assert "step 2" in message and "no plan this run can switch to fits" in message
    assert "strategies.loss" in message  # pinned here: the run may not switch it
    assert "strategies.optimizer_states" in message and "memory.budget" in message
    assert "Traceback" not in message and raised.value.__cause__ is None
    assert [r["to"]["checkpointing"] for r in trainer.monitor.replans] == [
        "full"
    ]  # it tried the stronger plan first


@pytest.fixture()
def budget_sweep(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import budget_sweep

    return budget_sweep


def test_ci_budget_sweep_finishes_under_budget_or_refuses_before_step_one(
    budget_sweep: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(budget_sweep.FAMILIES, "llama", {**TINY_LLAMA, "max_position_embeddings": 64})
    monkeypatch.setitem(budget_sweep.STRATEGIES, "checkpointing", ["none", "full"])
    monkeypatch.setitem(budget_sweep.STRATEGIES, "loss", ["standard", "chunked"])

    def in_process(family: str, fraction: float | None, budget: int | None, steps: int) -> Any:
        return budget_sweep.train_once(family, fraction, budget, steps, tmp_path / f"{family}-{fraction}")

    # 5%: below the weights; 35%: tight (plans recompute and shrink their states); 70%: roomy.
    runs = budget_sweep.sweep(["llama"], [0.05, 0.35, 0.7], 2, in_process, progress=False)
    by_fraction = {r.fraction: r for r in runs}
    assert by_fraction[None].status == "finished" and by_fraction[None].measured_peak
    assert by_fraction[0.05].status == "refused" and by_fraction[0.05].steps_done == 0
    for fraction in (0.35, 0.7):
        run = by_fraction[fraction]
        assert run.status == "finished", (fraction, run.error)
        assert run.steps_done == 2 and run.measured_peak <= run.budget
    assert "| llama | 35%" in budget_sweep.markdown(runs)
    assert not any(r.status in budget_sweep.FAILURES for r in runs), sys.stderr


def test_checkpointing_switches_in_place_and_back(tmp_path: Path) -> None:
    """`switch_in_place` unwraps the old mode before applying the new one (applying twice is refused), and
    `none` gives every block its class's forward back; the loss binding follows the plan."""
    from memtrain.strategies.apply import switch_in_place
    from memtrain.strategies.checkpointing import FullCheckpointing, NoCheckpointing
    from memtrain.strategies.loss import Chunked, Loss, bound_loss

    trainer = CausalLMTrainer(tiny_recipe(tmp_path))
    model = trainer.build_model()
    blocks = trainer.blocks(model)
    switch_in_place(model, blocks, FullCheckpointing(), Chunked())
    assert all("forward" in vars(b) for b in blocks) and bound_loss(model).strategy == Chunked()
    switch_in_place(model, blocks, FullCheckpointing(), Chunked())  # re-applying the same mode is fine
    switch_in_place(model, blocks, NoCheckpointing(), Loss())
    assert not any("forward" in vars(b) or hasattr(b, "_memtrain_checkpointing") for b in blocks)
    assert bound_loss(model).strategy == Loss()
