"""Out of memory in the middle of a zero3 step: FSDP2's accumulated unsharded gradients of the failed
attempt are dropped (`discard_step`), so the redone step equals a step that never failed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.training.trainer import Batch

from helpers import assert_trained_alike, initial_weights, tiny_recipe

SECTIONS = {
    "train": {"steps": 3, "lr": 1e-3},
    "batch": {"global_size": 8, "micro_size": 2},
    "strategies": {"sharding": "zero3"},
}


class FailOnce(CausalLMTrainer):
    """Raises out of memory in the third forward of the second step (two micro-steps accumulated)."""

    calls = 0

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.calls == 4 + 3:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return super().loss(model, batch)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _weights(trainer: CausalLMTrainer) -> dict[str, torch.Tensor]:
    assert trainer.model is not None
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in trainer.model.named_parameters()
    }


@pytest.mark.filterwarnings("ignore:strategies.sharding. zero3 on one rank")
def test_zero3_step_redone_after_oom_equals_uninterrupted(tmp_path: Path, one_rank_group: None) -> None:
    reference = CausalLMTrainer(tiny_recipe(tmp_path / "ref", **SECTIONS))
    expected = reference.fit().losses
    failing = FailOnce(tiny_recipe(tmp_path / "oom", **SECTIONS))
    losses = failing.fit().losses
    assert len(failing.monitor.oom_events) == 1 and failing.plan.micro_batch_size == 1
    assert losses == pytest.approx(expected, rel=1e-6)
    # The redone step runs micro-batches of one row, not two: the same gradient summed in another order,
    # compared as a whole (tests/helpers.py, `REDUCTION_ORDER`), not per element.
    unsharded = {**SECTIONS, "strategies": {"sharding": "none"}}  # the same seed and model, no group
    initial = initial_weights(tiny_recipe(tmp_path / "initial", **unsharded))
    assert_trained_alike(_weights(failing), _weights(reference), initial)
