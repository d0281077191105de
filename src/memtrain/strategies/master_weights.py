"""fp32 master weights for a model whose parameters and gradients are bf16 (`bf16-master`).

The model holds bf16 parameters (2 bytes each) and receives bf16 gradients. The user's optimizer is
built on fp32 copies of the parameters (the master weights, 4 bytes each). At each step the bf16
gradients are copied into fp32 master gradients, the inner optimizer steps the master weights, and the
result is rounded back into the bf16 parameters. Updates smaller than bf16's resolution are therefore
kept in the master copy and not lost, which is why this precision trains like fp32 while it halves the
weight and gradient bytes. The master weights are part of the optimizer's state_dict, so a resume is
exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer built on fp32 copies of low-precision model parameters."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        build_inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    ) -> None:
        self.model_params = [p for p in params if p.requires_grad]
        self.master_params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        self.inner = build_inner(self.master_params)
        super().__init__(self.master_params, self.inner.defaults)  # hooks and step patching of Optimizer
        # Share the inner optimizer's groups so that `group["lr"] = ...` reaches the real optimizer.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def gradients_to_master(self) -> list[nn.Parameter]:
        """Move the model's low-precision gradients into fp32 master gradients; returns the master
        parameters, whose gradients are the ones to clip."""
        for model_p, master_p in zip(self.model_params, self.master_params, strict=True):
            if model_p.grad is None:
                master_p.grad = None
                continue
            master_p.grad = model_p.grad.float()
            model_p.grad = None
        return [p for p in self.master_params if p.grad is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if any(p.grad is not None for p in self.model_params):
            self.gradients_to_master()
        loss = self.inner.step(closure)
        for model_p, master_p in zip(self.model_params, self.master_params, strict=True):
            model_p.copy_(master_p)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.model_params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "master": [p.detach() for p in self.master_params]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for master_p, saved in zip(self.master_params, state_dict["master"], strict=True):
                master_p.copy_(saved)
            for model_p, master_p in zip(self.model_params, self.master_params, strict=True):
                model_p.copy_(master_p)
