"""zero1 on the fsdp2 backend: DDP for the gradients, torch's ZeroRedundancyOptimizer for the states.

Why not FSDP2: FSDP2 always shards the parameters (it has no "optimizer states only" mode), so ZeRO-1
means DDP plus an optimizer that keeps states only for this rank's share of the parameters. Each rank
steps its share (whole tensors, largest first, to the least loaded rank) and broadcasts the updated
weights. Gradients are all-reduced by DDP exactly as in `ddp` (same `no_sync` accumulation, same
comm hooks), so the gradient - and the clipping norm, computed on the full gradients every rank
holds - is the one `ddp` computes.

The user's optimizer is rebuilt per rank from its class and its param groups (every group carries
its hyper-parameters), which keeps the user's `build_optimizer` (param groups, lr, betas) without
knowing its constructor. An optimizer whose constructor needs more than param groups (bf16-master's
`MasterWeightOptimizer`) cannot be rebuilt and is refused.

Checkpoints are the replicated files of `none`/`ddp` (the states are gathered to rank 0 first), so a
zero1 checkpoint resumes under any world size and under none/ddp, and the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import memtrain.strategies.sharding.ddp_hooks as ddp_hooks
import memtrain.strategies.sharding.sharded_checkpoint as sharded_checkpoint
from memtrain import checkpoint as ckpt
from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.memory.footprint import ModelShape
from memtrain.strategies.sharding.base import (
    DDPBackend,
    Materialise,
    OptimizerFactory,
    check_whole_parameters,
    warn_one_rank,
)
from memtrain.strategies.sharding.state_bytes import (
    ADAMW,
    OptimizerCost,
    QuantisedWeight,
    StateBytes,
    replicated_bytes,
    zero1_bytes,
)


@dataclass(frozen=True)
class Zero1Backend(DDPBackend):
    def check(self, env: DistEnv) -> None:
        check_whole_parameters(self.name, env)
        self.check_reduction()
        if self.options.offload != "none":
            raise Unsupported(
                f"strategies.sharding_offload: '{self.options.offload}' is not available for zero1 on the fsdp2 "
                "backend (torch's ZeroRedundancyOptimizer keeps its states on the device); set "
                "strategies.sharding_backend=deepspeed or strategies.sharding_offload=none"
            )
        if self.options.precision == "bf16-master":
            raise Unsupported(
                "strategies.precision: bf16-master cannot be combined with zero1 on the fsdp2 backend (its "
                "master-weight optimizer cannot be partitioned); use bf16-mixed, or strategies.sharding=zero2/zero3"
            )

    def prepare(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        env: DistEnv,
        make_optimizer: OptimizerFactory,
        materialise: Materialise | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        full = make_optimizer(model)
        if not env.distributed:
            warn_one_rank(self.name)
            return model, full
        wrapped = ddp_hooks.wrap_ddp(model, env, self.options.comm_hook)
        try:
            optimizer = ZeroRedundancyOptimizer(full.param_groups, optimizer_class=type(full))
        except TypeError as exc:
            raise Unsupported(
                f"strategies.sharding: zero1 rebuilds the optimizer on each rank's share from its class and "
                f"param groups, and {type(full).__name__} refuses that ({exc}); use zero2/zero3"
            ) from None
        return wrapped, optimizer

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
        if world_size == 1:
            return replicated_bytes(shape, self.options.precision, optimizer, ddp=False)
        return zero1_bytes(shape, world_size, self.options.precision, optimizer, rank)

    def save(self, staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)  # collective: every rank sends its states to rank 0
        super().save(staging, model, optimizer, env)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        found = sharded_checkpoint.detect_format(path)
        if found != "replicated":
            raise ckpt.CheckpointError(
                f"{path}: written by the {found} sharding format; zero1 resumes checkpoints of none, ddp or "
                "zero1 (resume it with the strategies.sharding it was saved with, then save under none/ddp)"
            )
        super().load(path, model, optimizer, env)
