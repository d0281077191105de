"""How the model and its states are laid out across data-parallel ranks: the backend interface.

The trainer talks to every layout through `ShardingBackend`. A backend wraps the model, may wrap the
optimizer, decides when gradients are synchronised across micro-steps, runs backward, and saves and
loads its own checkpoint files. `none` and `ddp` live here. The ZeRO stages live in their own modules
and are registered in `make_sharding`.

`ddp` keeps a full replica on each rank and all-reduces (averages) gradients after the last micro-step
of each step. Earlier micro-steps run under `no_sync`, so accumulation costs one all-reduce per step.
The trainer divides the loss by the global token count and multiplies by `grad_sync_scale`, which undoes
the backend's averaging. The result is the exact gradient of the global token mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memtrain import checkpoint as ckpt
from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass(frozen=True)
class ShardingBackend:
    """One rank holds everything (`none`). Subclasses override what their layout changes."""

    name: str

    def check(self, env: DistEnv) -> None:
        if env.distributed:
            raise Unsupported(
                f"strategies.sharding: '{self.name}' cannot train on {env.world_size} ranks; "
                "set strategies.sharding=ddp"
            )

    def prepare(self, model: nn.Module, blocks: list[nn.Module], env: DistEnv,
                make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model (already on its device) and build the optimizer on what this rank steps."""
        return model, make_optimizer(model)

    def grad_sync_scale(self, env: DistEnv) -> float:
        """Factor that undoes the backend's gradient averaging, so the loss is normalised globally."""
        return 1.0

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """Context of one micro-step's forward and backward (no gradient sync but on the last)."""
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # ------------------------------------------------------------------ checkpoints
    def save(self, staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        """Write model and optimizer state into `staging` (replicated states: rank 0 writes)."""
        if env.is_main:
            ckpt.save_tensor_file(staging / "model.pt", self.unwrap(model).state_dict())
            ckpt.save_tensor_file(staging / "optimizer.pt", optimizer.state_dict())

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        state = ckpt.load_tensor_file(path / "model.pt")
        try:
            self.unwrap(model).load_state_dict(state)
        except RuntimeError as exc:
            raise ckpt.CheckpointError(f"{path / 'model.pt'}: does not fit this model ({exc})") from None
        optimizer.load_state_dict(ckpt.load_tensor_file(path / "optimizer.pt"))


@dataclass(frozen=True)
class DDPBackend(ShardingBackend):
    def check(self, env: DistEnv) -> None:
        return None

    def prepare(self, model: nn.Module, blocks: list[nn.Module], env: DistEnv,
                make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        optimizer = make_optimizer(model)
        if not env.distributed:
            return model, optimizer
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids), optimizer

    def grad_sync_scale(self, env: DistEnv) -> float:
        return float(env.world_size)

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel) and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model


def make_sharding(name: str, **options: Any) -> ShardingBackend:
    """The backend for a sharding name (the recipe's `strategies.sharding`)."""
    if name == "none":
        return ShardingBackend(name)
    if name == "ddp":
        return DDPBackend(name)
    raise Unsupported(f"strategies.sharding: {name!r} is not available yet")
