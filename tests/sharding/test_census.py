"""The private torch API behind `census` (tests/sharding/census.py) (DDP's logging data) still reports the buckets.

DDP keeps its gradient buckets in C++; `_get_ddp_logging_data()["bucket_sizes"]` is the only view of
their size. If a torch upgrade renames it, this test says so before the byte tests do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from census import ddp_bucket_bytes, storage_bytes


def test_ddp_buckets_hold_one_copy_of_every_gradient() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        assert ddp_bucket_bytes(DistributedDataParallel(model)) == 4 * sum(
            p.numel() for p in model.parameters()
        )
        assert ddp_bucket_bytes(model) == 0
    finally:
        dist.destroy_process_group()


def test_storage_bytes_counts_shared_storage_once() -> None:
    flat = torch.zeros(10)
    assert storage_bytes([flat[:4], flat[4:], None]) == 40
