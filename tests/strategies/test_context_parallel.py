"""`split_sequence`: a context-parallel rank's contiguous columns of a micro-batch, with their positions.
(The split trained against one process: tests/parallel/test_mesh.py, the fsdp_x_cp job.)"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

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


def test_the_ring_is_torchs_context_parallel_sdpa() -> None:
    # The contract with torch's experimental API (private entry points): inside the context SDPA is torch's
    # context-parallel dispatch, which on this CPU stops at the CPU kernel it has no ring for (the reason a
    # CPU run refuses cp before step 1), and both the function and the load balancing come back after.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memtrain.distributed import one_process
    from memtrain.strategies.sharding.base import ensure_process_group

    ours = not dist.is_initialized()
    ensure_process_group(one_process())
    try:
        _check_the_ring(init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)))
    finally:
        if ours:  # the next test in this process may start its own
            dist.destroy_process_group()


def _check_the_ring(mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from memtrain.strategies.context_parallel import _torch_ring

    original = torch.nn.functional.scaled_dot_product_attention
    balanced = _attention._cp_options.enable_load_balance
    query = torch.randn(1, 2, 4, 8)
    with _torch_ring(mesh["cp"]):
        assert torch.nn.functional.scaled_dot_product_attention is not original
        assert _attention._cp_options.enable_load_balance is False  # contiguous shards (module docstring)
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
            torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert torch.nn.functional.scaled_dot_product_attention is original
    assert _attention._cp_options.enable_load_balance is balanced
