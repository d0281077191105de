"""Out of memory in the middle of a step: the same batch is re-split into smaller micro-batches and the
run goes on. A sample-id ledger proves no sample is lost or seen twice, and the result equals a run that
never ran out of memory (the gradient is normalised by the global token count, so the re-split is exact
up to float rounding)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.training.trainer import Batch

from helpers import tiny_recipe

SECTIONS = {
    "train": {"steps": 6, "lr": 1e-3},
    "batch": {"global_size": 8, "micro_size": 8},
    "checkpoint": {"every": 3, "at_end": True},
}


class Ledger(CausalLMTrainer):
    """Records the sample ids of every micro-batch whose backward completed, per attempt of each step,
    and raises an out-of-memory error on chosen (step, micro-step) calls of `loss`."""

    def __init__(self, *args: object, inject: set[tuple[int, int]] = frozenset(), **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.inject = set(inject)
        self.attempt_ids: dict[int, list[list[int]]] = {}

    def train_step(self, step: int) -> dict:
        self.step_now, self.calls = step, 0
        self.attempt_ids[step] = [[]]
        return super().train_step(step)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if (self.step_now, self.calls) in self.inject:
            self.inject.discard((self.step_now, self.calls))
            self.attempt_ids[self.step_now].append([])  # what follows is the retry
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 GiB")
        self.attempt_ids[self.step_now][-1].extend(batch["sample_ids"].tolist())
        return super().loss(model, batch)

    def used_samples(self, step: int) -> list[int]:
        return self.attempt_ids[step][-1]  # the attempt that completed


def _params(trainer: CausalLMTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_injected_oom_at_a_random_micro_step_loses_nothing(tmp_path: Path) -> None:
    rng = random.Random(7)
    step = rng.randrange(1, 5)
    reference = CausalLMTrainer(tiny_recipe(tmp_path / "ref", **SECTIONS))
    expected = reference.fit().losses

    micro_two = {**SECTIONS, "batch": {"global_size": 8, "micro_size": 2}}
    call = rng.randrange(1, 5)  # one of the 4 micro-steps of 2 samples
    trainer = Ledger(tiny_recipe(tmp_path / "oom", **micro_two), inject={(step, call)})
    losses = trainer.fit().losses

    assert len(trainer.monitor.oom_events) == 1 and trainer.monitor.oom_events[0]["step"] == step + 1
    assert trainer.plan.micro_batch_size == 1 and trainer.plan.accumulation_steps == 8
    for s in range(6):
        used = trainer.used_samples(s)
        batch_ids = trainer.step_batch(s)["sample_ids"].tolist()
        assert Counter(used) == Counter(batch_ids), f"step {s + 1}: every sample once, none lost"
    assert losses == pytest.approx(expected, abs=1e-6)
    for name, value in _params(reference).items():
        torch.testing.assert_close(_params(trainer)[name], value, atol=1e-6, rtol=0, msg=name)
    # the lowered micro-batch is saved with the checkpoint and reused on resume
    resumed = CausalLMTrainer(
        tiny_recipe(tmp_path / "oom", **{**micro_two, "train": {"steps": 7, "lr": 1e-3}})
    )
    resumed.fit(resume=True)
    assert resumed.plan.micro_batch_size == 1


def test_simulated_budget_oom_is_recovered_by_smaller_micro_batches(tmp_path: Path) -> None:
    """A real OutOfMemoryError from the simulated device budget (no injection): the budget fits 4
    samples per micro-batch but not 8."""
    probe = {}
    for micro in (8, 4):
        t = CausalLMTrainer(
            tiny_recipe(
                tmp_path / f"p{micro}",
                memory={"track": True},
                **{**SECTIONS, "batch": {"global_size": 8, "micro_size": micro}},
            )
        )
        t.fit()
        probe[micro] = max(r.peak_bytes for r in t.monitor.memory_reports)
    assert probe[4] < probe[8]
    budget = (probe[4] + probe[8]) // 2
    trainer = CausalLMTrainer(tiny_recipe(tmp_path / "run", memory={"budget": budget}, **SECTIONS))
    result = trainer.fit()
    assert len(trainer.monitor.oom_events) == 1 and trainer.monitor.oom_events[0]["micro_batch_size"] == 8
    assert trainer.plan.micro_batch_size == 4
    assert len(result.losses) == 6 and all(r.peak_bytes <= budget for r in trainer.monitor.memory_reports)


def test_oom_at_one_sample_per_micro_batch_is_a_clear_error(tmp_path: Path) -> None:
    from memtrain.errors import PlanError

    trainer = CausalLMTrainer(tiny_recipe(tmp_path, memory={"budget": "200KiB"}, **SECTIONS))
    with pytest.raises(PlanError, match="strategies.checkpointing"):
        trainer.fit()
