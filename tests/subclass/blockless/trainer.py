"""A Trainer subclass whose model has no repeated blocks: a GRU language model with a BatchNorm (buffers),
a branch its forward never runs (a trainable parameter that never gets a gradient), a dict output and an
auxiliary loss term (tests/subclass/test_blockless_model.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memtrain import Trainer

VOCAB = 100
LENGTH = 8


class GruLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.gru = nn.GRU(32, 64, batch_first=True, num_layers=2)
        self.norm = nn.BatchNorm1d(64)
        self.unused = nn.Linear(64, 64)  # never called: trains in name only
        self.head = nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden, _ = self.gru(self.embed(ids))
        hidden = self.norm(hidden.transpose(1, 2)).transpose(1, 2)
        return {"logits": self.head(hidden), "aux": hidden.pow(2).mean()}


class GruTrainer(Trainer):
    def build_model(self) -> nn.Module:
        return GruLM()

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.recipe.run.seed * 1_000_003 + step)
        ids = torch.randint(0, VOCAB, (self.per_rank_batch_size, LENGTH + 1), generator=generator)
        return {"ids": ids[:, :-1], "labels": ids[:, 1:], "weight": torch.ones(len(ids), LENGTH)}

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(batch["ids"])
        tokens = batch["weight"].sum()
        loss_sum = F.cross_entropy(out["logits"].flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return loss_sum + 0.1 * out["aux"] * tokens, tokens
