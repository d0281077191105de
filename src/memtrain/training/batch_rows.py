"""How the base Trainer cuts a batch into micro-batches: by rows, with what has no row dimension kept whole.

Why one place: `Trainer.planning_batch` (what the planner traces) and `Trainer.split_batch` (what the run
feeds) must agree on which tensors carry the batch's rows. A tensor whose first dimension is the batch's row
count is cut; anything else (a 0-dim step index or flag, a mask shared by every row) goes whole into every
micro-batch, as the planner traced it. And the token-budget split (`batch.micro_tokens`) needs each row's
length, which only row-major labels give.
"""

from __future__ import annotations

import torch

from memtrain.errors import MemtrainError
from memtrain.planner.spec import Batch


def checked_batch(batch: object, name: str) -> Batch:
    """`batch`, a `step_batch` hook's return value, if it is a dict of tensors; else one line naming `name`."""
    if isinstance(batch, dict) and batch and all(isinstance(v, torch.Tensor) for v in batch.values()):
        return batch
    if isinstance(batch, dict):
        wrong = {k: type(v).__name__ for k, v in batch.items() if not isinstance(v, torch.Tensor)}
        got = f"a dict with {wrong} (not tensors)" if wrong else "an empty dict"
    else:
        got = type(batch).__name__
    raise MemtrainError(
        f"{name}.step_batch(step) must return a dict of tensors (name -> tensor); it returned {got}"
    )


def row_count(batch: Batch) -> int:
    """The batch's rows: the largest first dimension of its tensors (1 when none has one)."""
    return max((v.shape[0] for v in batch.values() if v.dim()), default=1)


def split_rows(batch: Batch, micro_size: int, groups: list[list[int]] | None) -> list[Batch]:
    """Micro-batches of `micro_size` rows, or of the row indices in `groups`; tensors without the row
    dimension are in each of them whole."""
    rows = row_count(batch)
    whole = {k for k, v in batch.items() if not v.dim() or v.shape[0] != rows}
    if groups is not None:
        return [{k: v if k in whole else v[torch.tensor(g)] for k, v in batch.items()} for g in groups]
    return [
        {k: v if k in whole else v[i : i + micro_size] for k, v in batch.items()}
        for i in range(0, rows, micro_size)
    ]


def row_lengths(batch: Batch, ignore_index: int) -> list[int]:
    """Each row's length up to its last loss token, from `labels` of shape (rows, tokens)."""
    labels = batch.get("labels")
    if labels is None or labels.dim() != 2:
        found = "no 'labels'" if labels is None else f"labels of shape {tuple(labels.shape)}"
        raise MemtrainError(
            f"batch.micro_tokens: splitting by tokens needs each row's length, and the batch has {found} "
            "(not rows x tokens); override Trainer.row_tokens, or set batch.micro_size instead"
        )
    real = labels != ignore_index
    positions = torch.arange(1, real.shape[1] + 1).expand_as(real)
    return [int(n) for n in (positions * real).amax(dim=1).tolist()]
