"""Trainer subclasses with models unlike a transformer (tests/subclass/test_unusual_models.py): a GRU without
repeated blocks, with a BatchNorm (buffers), a branch its forward never runs (a trainable parameter that never
gets a gradient), a dict output and an auxiliary loss term; an MLP of BatchNorm blocks that cannot train on a
micro-batch of one row, with a dataclass output; one with a lazy module; torch's own nn.TransformerEncoder
(it deep-copies its layers while built); and hooks that break their contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass
class Logits:
    logits: torch.Tensor


class NormBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.norm = nn.BatchNorm1d(dim)  # training mode: needs more than one row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.norm(self.linear(x)))


class NormMlp(nn.Module):
    def __init__(self, lazy: bool = False) -> None:
        super().__init__()
        self.inp: nn.Module = nn.LazyLinear(64) if lazy else nn.Linear(FEATURES, 64)
        self.blocks = nn.ModuleList(NormBlock(64) for _ in range(4))
        self.head = nn.Linear(64, CLASSES)

    def forward(self, x: torch.Tensor) -> Logits:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        return Logits(self.head(hidden))


FEATURES, CLASSES = 20, 10


class NormMlpTrainer(Trainer):
    lazy = False

    def build_model(self) -> nn.Module:
        return NormMlp(self.lazy)

    def step_batch(self, step: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.recipe.run.seed * 1_000_003 + step)
        rows = self.per_rank_batch_size
        return {
            "x": torch.randn(rows, FEATURES, generator=generator),
            "y": torch.randint(0, CLASSES, (rows,), generator=generator),
            "step": torch.tensor(step),  # no row dimension: every micro-batch gets it whole
        }

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = F.cross_entropy(model(batch["x"]).logits, batch["y"], reduction="sum")
        return loss_sum, torch.tensor(len(batch["y"]))

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return len(batch["y"])


class LazyTrainer(NormMlpTrainer):
    lazy = True


class BareLossTrainer(NormMlpTrainer):
    """Returns the loss alone, not (loss_sum, num_tokens)."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return F.cross_entropy(model(batch["x"]).logits, batch["y"], reduction="sum")


class TupleBatchTrainer(NormMlpTrainer):
    """step_batch returns a tuple."""

    def step_batch(self, step: int) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return tuple(super().step_batch(step).values())


class NoOptimizerTrainer(NormMlpTrainer):
    """build_optimizer forgets its return."""

    def build_optimizer(self, params: Any) -> Any:
        torch.optim.SGD(params, lr=0.1)


class FunctionModelTrainer(NormMlpTrainer):
    """build_model returns the class, not a model."""

    def build_model(self) -> Any:
        return NormMlp


class NoBatchTrainer(Trainer):
    """Forgot step_batch."""

    def build_model(self) -> nn.Module:
        return NormMlp()


class EncoderLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


class EncoderTrainer(GruTrainer):
    def build_model(self) -> nn.Module:
        return EncoderLM()

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(batch["ids"])
        loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        return loss_sum, batch["weight"].sum()
