"""How the model and its states are laid out across data-parallel ranks.

`none`: one rank. `ddp`: full replica per rank, gradients all-reduced (averaged) after the last
micro-step of each step; earlier micro-steps run under `no_sync` so accumulation costs one all-reduce
per step. ZeRO stages come with the sharding issue.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported


@dataclass(frozen=True)
class Sharding:
    name: str

    def check(self, env: DistEnv) -> None:
        if self.name == "none" and env.distributed:
            raise Unsupported(
                f"strategies.sharding: 'none' cannot train on {env.world_size} ranks; set strategies.sharding=ddp"
            )

    def apply(self, model: nn.Module, env: DistEnv) -> nn.Module:
        if self.name == "ddp" and env.distributed:
            device_ids = [env.device.index] if env.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=device_ids)
        return model

    def grad_sync_scale(self, env: DistEnv) -> float:
        """Factor undoing the backend's gradient averaging, so the loss can be normalised globally."""
        return float(env.world_size) if self.name == "ddp" and env.distributed else 1.0

    def no_sync(self, model: nn.Module, last_micro_step: bool) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel) and not last_micro_step:
            return model.no_sync()
        return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a data-parallel wrapper."""
    return model.module if isinstance(model, DistributedDataParallel) else model
