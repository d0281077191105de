"""`split_sequence`: a context-parallel rank's contiguous columns of a micro-batch, with their positions.
(The split trained against one process: tests/parallel/test_mesh.py, the fsdp_x_cp job.)"""

from __future__ import annotations

import pytest
import torch

from memtrain.errors import RecipeError
from memtrain.strategies.context_parallel import split_sequence


def test_each_rank_gets_its_columns_and_their_positions() -> None:
    batch = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "labels": torch.arange(100, 116).reshape(2, 8),
        "sample_ids": torch.tensor([5, 9]),
    }
    parts = [split_sequence(batch, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), batch["input_ids"])
    assert torch.equal(torch.cat([p["labels"] for p in parts], dim=1), batch["labels"])
    assert parts[2]["position_ids"].tolist() == [[4, 5], [4, 5]]  # steps of one from the shard's offset
    assert all(torch.equal(p["sample_ids"], batch["sample_ids"]) for p in parts)  # per row: whole
    assert split_sequence(batch, 0, 1) is batch


def test_packed_rows_and_uneven_widths_are_refused() -> None:
    packed = {"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8), "position_ids": torch.zeros(1, 8)}
    with pytest.raises(RecipeError, match="data.packing"):
        split_sequence(packed, 0, 2)
    with pytest.raises(ValueError, match="does not split over 3"):
        split_sequence({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8)}, 0, 3)
