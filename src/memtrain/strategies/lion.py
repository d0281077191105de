"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): one state per parameter.

Why our own: no maintained Lion package is installed here, and the rule is four lines. Lion keeps only the
momentum (`exp_avg`, in the parameter's dtype): half of AdamW's state bytes, and no `step` counter. Each
step moves every weight by exactly `lr` in the direction of the sign of an interpolation of the momentum
and the gradient, with decoupled weight decay:

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

It is deterministic (no random rounding), so a resumed run steps exactly as an uninterrupted one from the
momentum its checkpoint holds. DTensor parameters (FSDP2) are updated through their local shards (the rule
is elementwise), their momentum sharded the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.optimizer import ParamsT

from memtrain.strategies.lowbit_adamw import local_tensor


class Lion(torch.optim.Optimizer):
    """Lion with decoupled weight decay; `betas` are (interpolation, momentum decay)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr and weight_decay must be >= 0; got {lr}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1); got {betas}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr: float = group["lr"]
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                p, grad, exp_avg = (local_tensor(t) for t in (param, param.grad, state["exp_avg"]))
                if group["weight_decay"] != 0:
                    p.mul_(1 - lr * group["weight_decay"])
                p.add_(exp_avg.lerp(grad, 1 - beta1).sign_(), alpha=-lr)
                exp_avg.lerp_(grad, 1 - beta2)
        return loss
