"""AdamW whose moment estimates are stored in bf16: half the optimizer-state bytes of torch's AdamW.

Why a custom optimizer: `torch.optim.AdamW` keeps `exp_avg` / `exp_avg_sq` in the dtype of the
parameter, so bf16 states would force bf16 parameters too. Here the parameters keep their dtype and
only the two moments are stored in bf16 (2 + 2 bytes per parameter instead of 4 + 4).

The update rule is torch's single-tensor AdamW, op for op and in the same order (decoupled weight
decay, bias correction, eps added after the bias-corrected square root), computed in fp32: states
are loaded and upcast, updated, the parameter is updated from the *unrounded* fp32 moments, and only
then are the moments rounded for storage. With `state_dtype=torch.float32` the result is therefore
bitwise equal to `torch.optim.AdamW` (foreach=False); with bf16 the first step's parameter update is
still bitwise equal and only what is stored is rounded.

Rounding is stochastic, on purpose. bf16 keeps 8 significant bits, so half an ulp is at least 2^-9
(0.2%) of the value. With beta2 = 0.999 one step changes `exp_avg_sq` by at most 0.1% when the
gradient shrinks; round-to-nearest rounds every such step back, and the second moment can never
decay (measured by the tests). Stochastic rounding is unbiased, so the stored moment decays on
average like the fp32 one. The random bits come from a private generator reseeded from (step,
parameter index): enabling bf16 states does not consume the global RNG (data order, dropout), a
resumed run rounds exactly as an uninterrupted one with nothing extra to checkpoint, and
data-parallel replicas round identically.

Parameters are rounded back to their own dtype by an ordinary (nearest) copy, except in
`StochasticBF16AdamW` (`strategies.precision: bf16-true`): there the bf16 parameters have no fp32 master
copy, and an update below half a bf16 ulp of the weight (lr 1e-4 against a weight of 0.1 is 1/40 of an
ulp) would be rounded away every step. The parameter is written with the same stochastic rounding as the
moments, from the same generator: unbiased, so the weight moves by the update on average, and as
reproducible as the moments (a resume continues bit for bit, with nothing more in the checkpoint).

Large tensors are processed in flat chunks of `chunk_numel` elements, so the temporaries (fp32 copies,
the denominator, the rounding noise: at most 32 bytes per chunk element) stay bounded however large
the embedding is. DTensor parameters
(FSDP2) are updated through their local shards, and their states are DTensors sharded the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

CHUNK_NUMEL = 1 << 22  # 4 Mi elements: at most ~128 MiB of temporaries (32 bytes per element)
_LOW_16_BITS_CLEARED = -(1 << 16)  # int32 mask 0xFFFF0000


def local_tensor(t: Tensor) -> Tensor:
    """The shard this rank stores: the local tensor of a DTensor, the tensor itself otherwise. Where
    torch.distributed.tensor was never imported (seconds: nothing sharded), no tensor is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if module is not None and isinstance(t, module.DTensor) else t


def round_stochastic_(dst: Tensor, src: Tensor, generator: torch.Generator) -> None:
    """Write fp32 `src` into bf16 `dst`, rounding up with probability equal to the dropped fraction.

    A bf16 value is the top 16 bits of an fp32 value; adding uniform noise in [0, 2^16) to the bit
    pattern and truncating rounds the magnitude up exactly with that probability (negative values
    work the same way, the sign bit being separate).
    """
    bits = src.view(torch.int32)
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=generator)
    dst.copy_(((bits + noise) & _LOW_16_BITS_CLEARED).view(torch.float32))


class BF16StateAdamW(torch.optim.Optimizer):
    """AdamW with moments stored in `state_dtype` (bf16 or fp32), computed in fp32; see the module doc.

    `step` is kept as a Python int per parameter (no tensor bytes). `state_dtype=torch.float32` exists
    to prove the update rule against torch's AdamW; `stochastic_rounding=False` (round to nearest)
    exists to show why the default is stochastic. `stochastic_params`: bf16 parameters are written with
    stochastic rounding too (`StochasticBF16AdamW`).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        stochastic_rounding: bool = True,
        chunk_numel: int = CHUNK_NUMEL,
        stochastic_params: bool = False,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0; got {lr}, {eps}, {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1); got {betas}")
        if state_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"state_dtype must be torch.bfloat16 or torch.float32; got {state_dtype}")
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be > 0; got {chunk_numel}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.chunk_numel = chunk_numel
        self.stochastic_params = stochastic_params
        self._generators: dict[torch.device, torch.Generator] = {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim.Optimizer casts every floating state tensor to the parameter's dtype on load,
        # which would silently turn bf16 moments into fp32 ones; cast them back (exact: they were bf16).
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1  # position over all groups: stable across save/resume, seeds the rounding
        for group in self.param_groups:
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("BF16StateAdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(
                        param, dtype=self.state_dtype, memory_format=torch.contiguous_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, dtype=self.state_dtype, memory_format=torch.contiguous_format
                    )
                state["step"] += 1
                tensors = [
                    local_tensor(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
                ]
                generator = self._generator(tensors[0].device, state["step"], index)
                for chunk in _chunks(tensors, self.chunk_numel):
                    self._update(*chunk, group=group, step=state["step"], generator=generator)
        return loss

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        generator.manual_seed((step * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63))
        return generator

    def _update(
        self,
        param: Tensor,
        grad: Tensor,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        *,
        group: dict[str, Any],
        step: int,
        generator: torch.Generator,
    ) -> None:
        """torch's single-tensor AdamW step (same ops, same order, same Python-float scalars) in fp32."""
        lr: float = group["lr"]
        beta1, beta2 = group["betas"]
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        # `.float()` returns the tensor itself when it is already fp32, so fp32 storage is updated in place.
        p32, g32, m32, v32 = param.float(), grad.float(), exp_avg.float(), exp_avg_sq.float()
        if group["weight_decay"] != 0:
            p32.mul_(1 - lr * group["weight_decay"])
        m32.lerp_(g32, 1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        denom = (v32.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        p32.addcdiv_(m32, denom, value=-step_size)
        if p32 is not param:
            if self.stochastic_params and param.dtype == torch.bfloat16:
                round_stochastic_(param, p32, generator)
            else:
                param.copy_(p32)
        for stored, exact in ((exp_avg, m32), (exp_avg_sq, v32)):
            if exact is stored:
                continue
            if self.stochastic_rounding:
                round_stochastic_(stored, exact, generator)
            else:
                stored.copy_(exact)


class StochasticBF16AdamW(BF16StateAdamW):
    """`BF16StateAdamW` whose bf16 parameters are written with stochastic rounding (`bf16-true`: no master
    copy). A class of its own, so that zero1's ZeroRedundancyOptimizer, which rebuilds the optimizer from
    its class and param groups, rebuilds this one."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        chunk_numel: int = CHUNK_NUMEL,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, chunk_numel=chunk_numel, stochastic_params=True
        )


def _chunks(tensors: list[Tensor], chunk_numel: int) -> Iterator[tuple[Tensor, ...]]:
    """Matching flat slices of same-shaped tensors, `chunk_numel` elements at a time.

    Tensors that are small or not all contiguous are yielded whole (the update is elementwise, so
    any shape works; only slicing needs flat views that alias the storage).
    """
    numel = tensors[0].numel()
    if numel <= chunk_numel or not all(t.is_contiguous() for t in tensors):
        yield tuple(tensors)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, numel, chunk_numel):
        yield tuple(t[start : start + chunk_numel] for t in flat)
