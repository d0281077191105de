"""Measured per-rank bytes of the model states, to hold `ShardingBackend.state_bytes` to the byte.

Why storages: a sharded backend's tensors are views (FSDP2's padded shards, DeepSpeed's flat
buffers, DDP's buckets), so summing tensor sizes under- or over-counts. We sum the distinct
storages behind what each backend keeps, read at the moment each component exists:

- weights and gradients just before an optimizer step (FSDP2's sharded parameters and reduced
  gradients, DeepSpeed's flat buffers and partitions);
- optimizer states just after it (the moments exist from the first step on);
- gathered weights at the end of forward (FSDP2's unsharded parameters are the module's parameters
  until they are resharded; DeepSpeed ZeRO-3's gathered `param.data`);
- DDP's gradient buckets from DDP's logging data (`_get_ddp_logging_data`, private: this module is
  the only user, and tests/sharding/test_census.py fails loudly if torch changes it).

`CensusTrainer` is the causal-LM trainer with these readings taken on its second step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.strategies.optimizer import measured_state_bytes
from memtrain.strategies.sharding.base import ShardingBackend
from memtrain.strategies.sharding.deepspeed_backend import DeepSpeedBackend
from memtrain.strategies.sharding.fsdp2 import FSDP2Backend
from memtrain.strategies.sharding.state_bytes import StateBytes
from memtrain.training.trainer import Batch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    seen: dict[tuple[torch.device, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        seen[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets (0 for a model that is not in DDP)."""
    if not isinstance(model, DistributedDataParallel):
        return 0
    sizes = str(model._get_ddp_logging_data()["bucket_sizes"])
    return sum(int(size) for size in sizes.split(",") if size.strip())


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def weights(backend: ShardingBackend, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    if isinstance(backend, DeepSpeedBackend):
        if backend.stage == 3:
            return storage_bytes(p.ds_tensor for p in backend.unwrap(model).parameters())  # type: ignore[attr-defined]
        return storage_bytes(optimizer.bit16_groups_flat)  # type: ignore[attr-defined]
    return storage_bytes(backend.unwrap(model).parameters())


def gathered(backend: ShardingBackend, model: nn.Module) -> int:
    """Unsharded weights alive now (read after forward)."""
    params = list(backend.unwrap(model).parameters())
    if isinstance(backend, DeepSpeedBackend):
        return storage_bytes(p.data for p in params if backend.stage == 3 and p.data.numel() > 0)
    if isinstance(backend, FSDP2Backend):
        return storage_bytes(p for p in params if not isinstance(p, DTensor))
    return 0


def gradients(backend: ShardingBackend, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    if isinstance(backend, DeepSpeedBackend):
        if backend.stage == 3:
            return storage_bytes([optimizer.grad_partitions_flat_buffer])  # type: ignore[attr-defined]
        held = optimizer.averaged_gradients  # type: ignore[attr-defined]
        return storage_bytes(
            t for grads in held.values() if grads is not None for t in grads
        )  # None: offloaded
    return storage_bytes(p.grad for p in _params(optimizer))


def optimizer_states(backend: ShardingBackend, optimizer: torch.optim.Optimizer) -> int:
    if isinstance(backend, DeepSpeedBackend):
        masters = (
            optimizer.fp32_partitioned_groups_flat
            if backend.stage == 3  # type: ignore[attr-defined]
            else optimizer.single_partition_of_fp32_groups
        )  # type: ignore[attr-defined]
        return storage_bytes(masters) + measured_state_bytes(optimizer.optimizer)  # type: ignore[attr-defined]
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return measured_state_bytes(optimizer.optim)
    return measured_state_bytes(optimizer)


class CensusTrainer(CausalLMTrainer):
    """Records this rank's measured `StateBytes` at the second optimizer step (`self.census`): the
    first step creates the optimizer states, and DeepSpeed ZeRO-3 keeps its persistent parameters
    gathered only from the end of the first step on. Gathered weights are the most seen at the end
    of any forward until then."""

    census: StateBytes | None = None
    _gathered: int = 0
    _steps_seen: int = 0

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        result = super().loss(model, batch)
        if self.census is None:
            self._gathered = max(self._gathered, gathered(self.sharding, model))
        return result

    def optimizer_step(self) -> tuple[float, bool]:
        assert self.model is not None and self.optimizer is not None
        self._steps_seen += 1
        if self.census is not None or self._steps_seen < 2:
            return super().optimizer_step()
        held: dict[str, Any] = {
            "weights": weights(self.sharding, self.model, self.optimizer),
            "gradients": gradients(self.sharding, self.model, self.optimizer),
            "buffers": ddp_bucket_bytes(self.model),
            "gathered": self._gathered,
        }
        result = super().optimizer_step()
        self.census = StateBytes(optimizer_states=optimizer_states(self.sharding, self.optimizer), **held)
        return result
