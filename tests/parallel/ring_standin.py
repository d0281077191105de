"""A CPU stand-in for torch's context-parallel ring attention, for the mesh tests' cp jobs.

torch's ring (memtrain.strategies.context_parallel._torch_ring) dispatches the CUDA attention kernels
only. This stand-in gives every rank of the context-parallel group the whole row's keys and values (an
all-gather, its backward the sum of every rank's gradient for this rank's part) and attends this rank's
queries to them under the causal mask of their true positions: the same attention, so a cp job must train
as one process does. What it checks is memtrain's side: the rows split by columns with their positions, the
loss normalised over every rank's tokens, the gradients reduced over dp_shard x cp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import memtrain.plan
from memtrain.strategies import context_parallel

SEEN: set[tuple[int, int]] = set()
"""(this rank's query columns, the row's key columns) of every attention the stand-in ran."""


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2); backward: every rank's gradient of this rank's part, summed."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        rank, ranks = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        share = total.shape[2] // ranks
        return total[:, :, rank * share : (rank + 1) * share], None


@contextlib.contextmanager
def gathered_ring(mesh: DeviceMesh) -> Iterator[None]:
    group = mesh.get_group()
    original = torch.nn.functional.scaled_dot_product_attention

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        assert not args and kwargs.pop("attn_mask", None) is None, "a mask: the ring cannot take one"
        causal = kwargs.pop("is_causal", False)
        keys, values = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
        local = query.shape[2]
        SEEN.add((local, keys.shape[2]))
        start = dist.get_rank(group) * local
        positions = torch.arange(start, start + local).unsqueeze(1)
        mask = torch.arange(keys.shape[2]).unsqueeze(0) <= positions if causal else None
        return original(query, keys, values, attn_mask=mask, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = attend
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def install() -> None:
    """Let this process run context parallelism on CPU through the stand-in."""
    context_parallel._torch_ring = gathered_ring  # type: ignore[assignment]
    memtrain.plan.RING_ATTENTION_DEVICES = ("cuda", "cpu")  # type: ignore[misc]
