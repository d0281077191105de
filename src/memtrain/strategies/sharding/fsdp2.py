"""zero2 and zero3 on FSDP2 (`torch.distributed.fsdp.fully_shard`).

Why FSDP2: it shards each parameter as a DTensor on dim 0, so the optimizer, gradient clipping and
DCP checkpoints work on ordinary (sharded) tensors, and its per-module groups let us choose how long
gathered weights live. Each transformer block is one group, then the root (embeddings, final norm,
head); a block's weights are all-gathered just before it runs.

- zero3: `reshard_after_forward=True` for the blocks: a block's gathered weights are freed after its
  forward and gathered again in backward. The root keeps FSDP2's default (gathered from forward to
  backward: the head is the first thing backward needs).
- zero2: `reshard_after_forward=False`: every gathered weight lives from forward to backward (no
  second all-gather; the memory of a full replica of the weights between the two passes).

Precision: bf16-mixed becomes `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`. The
sharded parameters stay fp32 (they are the master weights the optimizer updates); blocks compute with
bf16 copies gathered in bf16 (half the all-gather bytes); gradients are reduce-scattered and kept in
fp32. Unlike the autocast reference (fp32 parameters cast per matmul), the embeddings, norm weights
and residual stream are bf16 here, so bf16-mixed numerics differ from `none` at bf16 resolution.
bf16-true shards its bf16 parameters as they are (no policy: gathers, gradients and reductions in bf16;
its optimizer rounds each rank's shard stochastically). bf16-master (fp32 masters are what FSDP2's
bf16-mixed already keeps) and fp16-mixed (GradScaler over sharded gradients) are refused with the
alternative named.

Accumulation (`gradient_reduction`): `per_step` (the default) switches reduction off on non-final
micro-steps (`set_requires_gradient_sync(False)`), so each rank accumulates an unsharded fp32 gradient
of the whole model until the last micro-step, then reduce-scatters once: less communication, and on a
large model more memory than ZeRO's sharded gradients save (`fsdp2_bytes` counts it). `per_micro_step`
keeps the sync on: every micro-step's backward reduce-scatters each group's gradient and FSDP2 adds the
shard to the sharded `.grad` (torch's `foreach_reduce`), so gradients stay sharded, at one
reduce-scatter per micro-step. Both sum the same micro-step gradients, each averaged over ranks once,
so the step's gradient is the same up to fp32 summation order. The averaging reduce-scatter is undone
by `grad_sync_scale`, and torch's `clip_grad_norm_` computes the norm over DTensor gradients globally
(a Replicate DTensor), so clipping is exact. Out of memory mid-step: `discard_step` drops the unsharded
accumulation before the trainer redoes the step.

Offload: `sharding_offload=params` is `CPUOffloadPolicy`: sharded weights, gradients and the optimizer
step on the CPU (FSDP2 offloads them together, so `optimizer` alone is refused). The gathered weights
and, under `per_step` accumulation, the unsharded gradient stay on the device, so offload plans with
accumulation want `per_micro_step`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

import memtrain.strategies.sharding.sharded_checkpoint as sharded_checkpoint
from memtrain.distributed import DistEnv
from memtrain.errors import MemtrainError, Unsupported
from memtrain.memory.footprint import ModelShape
from memtrain.strategies.expert_parallel import expert_meshes, is_experts
from memtrain.strategies.sharding.base import (
    Materialise,
    OptimizerFactory,
    ShardingBackend,
    ensure_process_group,
    warn_one_rank,
)
from memtrain.strategies.sharding.state_bytes import (
    ADAMW,
    OptimizerCost,
    QuantisedWeight,
    StateBytes,
    fsdp2_bytes,
)

REFUSED_PRECISIONS = {
    "bf16-master": "FSDP2's bf16-mixed already keeps sharded fp32 master weights and computes in bf16; "
    "use strategies.precision=bf16-mixed",
    "fp16-mixed": "fp16 loss scaling over sharded gradients is not supported here; use bf16-mixed",
    "fp8": "float8 all-gathers under FSDP2 are not wired up yet; use bf16-mixed or strategies.sharding=ddp",
}


@dataclass(frozen=True)
class FSDP2Backend(ShardingBackend):
    shards_meta_models: ClassVar[bool] = True
    checkpoint_format: ClassVar[str] = "dcp"
    reduces_over_context_ranks: ClassVar[bool] = True
    shards_experts: ClassVar[bool] = True

    @property
    def reshard_after_forward(self) -> bool:
        return self.name == "zero3"

    def offloads(self) -> tuple[str, ...]:
        return ("none", "params")

    def reductions(self) -> tuple[str, ...]:
        return ("per_step", "per_micro_step")

    def check(self, env: DistEnv) -> None:
        self.check_reduction()
        if self.options.offload == "optimizer":
            raise Unsupported(
                "strategies.sharding_offload: FSDP2 offloads weights, gradients and optimizer states together; "
                "set strategies.sharding_offload=params, or strategies.sharding_backend=deepspeed to offload "
                "only the optimizer"
            )
        if self.options.comm_hook != "none":
            raise Unsupported(
                f"strategies.comm_hook: '{self.options.comm_hook}' is a DDP hook (ddp, zero1); FSDP2 reduce-"
                "scatters in the precision's reduce dtype; set strategies.comm_hook=none"
            )
        reason = REFUSED_PRECISIONS.get(self.options.precision)
        if reason is not None:
            raise Unsupported(
                f"strategies.precision: {self.options.precision} with {self.name} on FSDP2: {reason}"
            )

    def prepare(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        env: DistEnv,
        make_optimizer: OptimizerFactory,
        materialise: Materialise | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not env.distributed:
            warn_one_rank(self.name)
        ensure_process_group(env)
        options: dict[str, Any] = {
            "mesh": data_parallel_mesh(env),
            "mp_policy": self._mixed_precision(),
            "offload_policy": CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
            if self.options.offload == "params"
            else OffloadPolicy(),
        }
        if (
            env.shape.ep > 1
        ):  # experts first (a block's group then leaves them out), over the ranks outside ep
            _, outside = expert_meshes(env)
            for experts in (m for m in model.modules() if is_experts(m)):
                fully_shard(
                    experts, reshard_after_forward=self.reshard_after_forward, **{**options, "mesh": outside}
                )
        for block in blocks:
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **options)
        # The root: FSDP2's default for zero3 (kept from forward to backward), never resharded for zero2.
        fully_shard(model, reshard_after_forward=None if self.reshard_after_forward else False, **options)
        if materialise is not None:  # a meta-parameter model: each rank fills only its shards
            materialise(model)
        return model, make_optimizer(model)

    def _mixed_precision(self) -> MixedPrecisionPolicy:
        if self.options.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def grad_sync_scale(self, env: DistEnv) -> float:
        return float(env.dp_size * env.shape.cp)  # the context-parallel ranks are averaged over too

    @contextlib.contextmanager
    def _sync(self, model: nn.Module, last: bool) -> Iterator[None]:
        assert isinstance(model, FSDPModule), type(model)
        model.set_requires_gradient_sync(last or self.gradient_reduction == "per_micro_step")
        yield

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        return self._sync(model, last)

    def discard_step(self, model: nn.Module) -> None:
        """Drop what the failed step's earlier micro-steps accumulated inside FSDP2 (unsharded gradients,
        not in `.grad`), then `reset_iter_state` (reshards, drops in-flight reductions). torch 2.13's
        reset keeps the no-sync accumulation despite its docstring, so it is cleared here through
        FSDP2's private per-parameter state; tests/sharding/test_recovery.py fails if that changes."""
        if not hasattr(model, "reset_iter_state"):
            raise MemtrainError(
                "out-of-memory recovery under FSDP2 needs torch >= 2.13 (FSDPModule.reset_iter_state); "
                "upgrade torch or lower batch.micro_size"
            )
        for module in model.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        fsdp_param.unsharded_accumulated_grad = None
                        if hasattr(fsdp_param, "_unsharded_param"):
                            fsdp_param._unsharded_param.grad = None
        model.reset_iter_state()  # type: ignore[operator]

    def state_bytes(
        self,
        shape: ModelShape,
        world_size: int,
        optimizer: OptimizerCost = ADAMW,
        *,
        dim0: Mapping[str, int] | None = None,
        rank: int | None = None,
        quantised: Mapping[str, QuantisedWeight] | None = None,
    ) -> StateBytes:
        return fsdp2_bytes(
            shape,
            world_size,
            self.options.precision,
            optimizer,
            reshard_after_forward=self.reshard_after_forward,
            accumulation_steps=self.options.accumulation_steps,
            reduce_every_micro_step=self.gradient_reduction == "per_micro_step",
            offload=self.options.offload == "params",
            dim0=dim0,
            rank=rank,
            quantised=quantised,
        )

    def save(self, staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        sharded_checkpoint.save_sharded(staging, model, optimizer)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        sharded_checkpoint.load_sharded(path, model, optimizer)


def data_parallel_mesh(env: DistEnv) -> DeviceMesh:
    """What FSDP2 shards over: every rank on a flat mesh; on a mesh, the shard group, or (replicas > 1)
    the 2-D replicas x shards mesh, which `fully_shard` runs as HSDP (shards within a replica, gradients
    all-reduced across replicas). With context parallelism the shard group is dp_shard x cp, flattened:
    the context-parallel ranks' gradients are of other tokens of the same rows (context_parallel.py)."""
    if env.shape.is_flat:
        return init_device_mesh(env.device.type, (env.world_size,))
    mesh = env.device_mesh
    assert mesh is not None, "apply_strategies builds the run's device mesh"
    shards = "dp_shard"
    if env.shape.cp > 1:
        shards = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shards)  # named on the root mesh (DeviceMesh keeps one per name)
    if env.shape.dp_replicate > 1:
        return mesh["dp_replicate", shards]
    return mesh[shards]
