"""torchao's `AdamW4bit` stepped eagerly, with checkpoints that load under `weights_only=True`.

Why a subclass: torchao steps each parameter through `torch.compile(single_param_adam)`, one compiled
graph per parameter shape; on a CPU (and in the planner's step-time probe) that is seconds to minutes of
compilation before the first step, for a step that is memory-bound anyway. Here each parameter runs the
same function, torchao's own `single_param_adam`, without compiling it: the same update and the same
4-bit states (`OptimState4bit`: two 4-bit codes per byte, one fp32 scale per `block_size` elements, a
16-entry fp32 map per state tensor; tensors under 4096 elements or not a multiple of the block keep
states in the parameter dtype). The learning rate may be the plain float the trainer's schedule writes.

And its states are tensor subclasses, which a checkpoint read with `weights_only=True` refuses: `state_dict`
writes each as its plain tensors (`exp_avg.codes`, `exp_avg.scale`, `exp_avg.qmap`), and `load_state_dict`
makes them 4-bit states again, so a resume continues from exactly the stored codes. Imported only when
`strategies.optimizer_states: 4bit` builds it (torchao: `pip install 'memtrain[fp8]'`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import ParamsT
from torchao.optim import AdamW4bit
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_4bit import OptimState4bit

PARTS = ("codes", "scale", "qmap")
SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the first moment has a sign, the second does not


class EagerAdamW4bit(AdamW4bit):  # type: ignore[misc]
    """`AdamW4bit` without `torch.compile`, whose state dict holds plain tensors (module doc)."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, group)
        return loss

    def _step_one(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(param, True)
            state["exp_avg_sq"] = self._new_buffer(param, False)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        single_param_adam(
            param.detach(),
            param.grad,
            state["step"],
            state["exp_avg"],
            state["exp_avg_sq"],
            None,
            group["lr"],
            beta1,
            beta2,
            group["weight_decay"],
            group["eps"],
            True,
            False,
        )

    def state_dict(self) -> dict[str, Any]:
        full = super().state_dict()
        full["state"] = {index: _plain(state) for index, state in full["state"].items()}
        return full  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts every floating state tensor to its parameter's dtype on load (the fp32 scales and map
        # would become bf16 beside bf16 parameters): the 4-bit parts are set aside and only moved.
        parts = {i: {k: v for k, v in s.items() if _is_part(k)} for i, s in state_dict["state"].items()}
        rest = {i: {k: v for k, v in s.items() if not _is_part(k)} for i, s in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        indices = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, param in zip(indices, params, strict=True):
            saved = parts.get(index, {})
            for key, signed in SIGNED.items():
                if f"{key}.codes" in saved:
                    tensors = [saved[f"{key}.{part}"].to(param.device) for part in PARTS]
                    self.state[param][key] = OptimState4bit(*tensors, signed, param.shape, dtype=param.dtype)


def _is_part(key: str) -> bool:
    return "." in key and key.rsplit(".", 1)[1] in PARTS


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """One parameter's state with each 4-bit state as its three plain tensors."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, OptimState4bit):
            out.update({f"{key}.{part}": getattr(value, part) for part in PARTS})
        else:
            out[key] = value
    return out
