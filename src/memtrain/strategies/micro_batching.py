"""Micro-batching: how a rank's share of the step batch is cut into micro-batches (gradient accumulation).

Two strategies, both exact (the trainer normalises the loss by the global token count, so any partition
gives the same gradient):

- `sequences`: slices of `size` rows; `accumulation_steps` = rows per rank / `size`.
- `tokens`: a token budget per micro-batch (`batch.micro_tokens`). With variable-length data a fixed
  number of sequences per micro-batch wastes memory on short rows and runs out of it on long ones. A
  token budget bounds what a micro-batch costs (rows x longest row, since rows are padded to the longest).
  Rows are taken longest first, so each micro-batch holds rows of similar length and little padding.

Facts the planner and the trainer read: `tokens(seq_len)` (the largest micro-batch), `micro_steps(seq_len)`
and `smaller(rows_per_rank)`, the next plan an out-of-memory recovery falls back to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from memtrain.strategies.registry import Registry, Strategy

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class MicroBatching(Strategy):
    """`sequences`: `size` rows per micro-batch, `accumulation_steps` micro-batches per step."""

    kind: ClassVar[str] = "micro_batching"
    name: ClassVar[str] = "sequences"
    size: int = 1
    accumulation_steps: int = 1

    @property
    def rows(self) -> int:
        """Rows per rank per step."""
        return self.size * self.accumulation_steps

    def tokens(self, seq_len: int) -> int:
        """Tokens of the largest micro-batch."""
        return self.size * seq_len

    def micro_steps(self, seq_len: int) -> int:
        """Micro-steps per step (with a token budget: at least, when every row is full length)."""
        return -(-self.rows * seq_len // self.tokens(seq_len))

    def split(self, batch: Batch, row_tokens: Callable[[Batch], list[int]]) -> list[list[int]] | None:
        """Row indices per micro-batch, or None for plain slices of `size` rows."""
        return None

    def smaller(self) -> MicroBatching | None:
        """The largest smaller micro-batch that divides the rows (None: one row already)."""
        size = next((d for d in range(self.size // 2, 0, -1) if self.rows % d == 0), None)
        return None if size is None else MicroBatching(size, self.rows // size)

    def describe(self) -> str:
        return f"{self.size} x {self.accumulation_steps}"


MICRO_BATCHING: Registry[MicroBatching] = Registry("micro_batching", MicroBatching)
MICRO_BATCHING.register(MicroBatching)


@MICRO_BATCHING.register
@dataclass(frozen=True)
class TokenBudget(MicroBatching):
    """`tokens`: rows packed longest-first under `max_tokens` padded tokens per micro-batch; `size` is
    the rows per rank (one micro-batch when they all fit)."""

    name: ClassVar[str] = "tokens"
    max_tokens: int = 1

    def tokens(self, seq_len: int) -> int:
        return self.max_tokens

    def split(self, batch: Batch, row_tokens: Callable[[Batch], list[int]]) -> list[list[int]] | None:
        return pack_by_tokens(row_tokens(batch), self.max_tokens)

    def smaller(self) -> MicroBatching | None:
        if self.max_tokens <= 1:
            return None
        return TokenBudget(self.size, self.accumulation_steps, self.max_tokens // 2)

    def describe(self) -> str:
        return f"{self.max_tokens} tokens"


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per micro-batch, each within `max_tokens` padded tokens (a single row longer than
    the budget gets a micro-batch of its own). Deterministic: ties keep the original order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for row in order:
        if groups:
            current = groups[-1]
            longest = lengths[current[0]]  # sorted: the first row is the longest
            if (len(current) + 1) * max(longest, 1) <= max_tokens:
                current.append(row)
                continue
        groups.append([row])
    return groups
