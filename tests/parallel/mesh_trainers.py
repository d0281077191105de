"""A `Trainer` subclass with its own model and its own tensor-parallel plan (`tensor_parallel_plan`), for
the mesh tests: plain PyTorch, no transformers. Its MLP blocks split `up` by columns and `down` by rows;
the embedding, norms and head stay whole on every tensor rank. `RecordingTrainer` is the built-in causal-LM
trainer noting the sample ids each step reads on this rank (the resume tests)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memtrain import Trainer
from memtrain.causal_lm.data import Batch
from memtrain.causal_lm.trainer import CausalLMTrainer

from helpers import inflate_last_report

VOCAB, DIM, IGNORE = 64, 32, -100


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLPLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TokenRowsTrainer(Trainer):
    """Rows of a step are a function of the step alone; each data-parallel rank reads its own rows, and the
    model maps token ids to logits over `VOCAB`."""

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        size, share = self.recipe.batch.global_size, self.per_rank_batch_size
        tokens = torch.randint(0, VOCAB, (size, 17), generator=torch.Generator().manual_seed(step))
        mine = tokens[self.env.dp_rank * share : (self.env.dp_rank + 1) * share]
        return {"ids": mine[:, :-1], "labels": mine[:, 1:]}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["ids"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return loss_sum, (batch["labels"] != IGNORE).sum()


class SplitMLPTrainer(TokenRowsTrainer):
    """An MLP language model with a tensor-parallel plan."""

    def build_model(self) -> nn.Module:
        return MLPLM()

    def tensor_parallel_plan(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


class NoPlanTrainer(SplitMLPTrainer):
    """The same job without a tensor-parallel plan: tp > 1 is refused."""

    tensor_parallel_plan = Trainer.tensor_parallel_plan


class RecordingTrainer(CausalLMTrainer):
    """The causal-LM trainer, noting per step the sample ids this rank's share of the batch holds (the last
    read of a step wins: planning probes read step 0 too)."""

    seen_ids: dict[int, list[int]]

    def step_batch(self, step: int) -> Batch:
        batch = super().step_batch(step)
        if not hasattr(self, "seen_ids"):
            self.seen_ids = {}
        self.seen_ids[step] = batch["sample_ids"].tolist()
        return batch


class OverBudgetRank(RecordingTrainer):
    """`RecordingTrainer` whose rank `OVER` reports step 1's tracked memory 1% over the usable budget (more
    activations than the step really had, still under the simulated device budget), as
    tests/test_replan.py's `InflatedFirstStep` does on one device: a prediction that was low on one rank of
    a mesh, which the first step's calibration gathers from every rank (not an out-of-memory error)."""

    OVER = 3

    def train_step(self, step: int) -> dict[str, Any]:
        row = super().train_step(step)
        if step == 0 and self.env.rank == self.OVER:
            inflate_last_report(self)
        return row
