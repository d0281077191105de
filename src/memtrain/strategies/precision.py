"""Numerical precision of the forward/backward pass and of the stored weights.

| name        | weights / grads (B/param) | master copy | compute                                             |
|-------------|---------------------------|-------------|-----------------------------------------------------|
| fp32        | 4 / 4                     | -           | fp32                                                |
| bf16-mixed  | 4 / 4                     | -           | bf16 autocast                                       |
| bf16-master | 2 / 2                     | 4 (fp32, kept by the optimizer) | bf16                            |
| fp16-mixed  | 4 / 4                     | -           | fp16 autocast, dynamic loss scaling (GradScaler)    |
| fp8         | 4 / 4                     | -           | torchao float8 for the blocks' linears, bf16 elsewhere |

Precision changes numerics, so the planner only picks among the names a recipe allows. fp16-mixed
skips steps whose gradients are not finite and lowers the loss scale; the trainer counts those skips.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from memtrain.errors import Unsupported
from memtrain.footprint import Footprint, ModelShape
from memtrain.strategies.master_weights import MasterWeightOptimizer

AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    name: str
    fp8_emulate: bool = False  # torchao's emulated float8 (for CPU and debugging; slow, same numerics)

    def check(self, device: torch.device) -> None:
        if self.name in ("bf16-mixed", "bf16-master", "fp8") and device.type == "cuda" \
                and not torch.cuda.is_bf16_supported():
            raise Unsupported(
                f"strategies.precision: {self.name} needs a GPU with bf16 (compute capability >= 8.0); "
                "use fp16-mixed or fp32"
            )
        if self.name == "fp8":
            if importlib.util.find_spec("torchao") is None:
                raise Unsupported("strategies.precision: fp8 needs torchao; pip install 'memtrain[fp8]'")
            if self.fp8_emulate:
                return
            if device.type != "cuda":
                raise Unsupported(
                    "strategies.precision: fp8 needs a CUDA GPU with compute capability >= 8.9 (H100, L4, "
                    "RTX 4090); found none. Use bf16-mixed, or strategies.fp8_emulate=true to emulate"
                )
            major, minor = torch.cuda.get_device_capability(device)
            if (major, minor) < (8, 9):
                raise Unsupported(
                    f"strategies.precision: fp8 needs compute capability >= 8.9; found {major}.{minor}. "
                    "Use bf16-mixed"
                )

    # ------------------------------------------------------------------ application (setup order)

    def swap_modules(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """fp8: replace the blocks' nn.Linear layers by torchao Float8Linear (first in the order)."""
        if self.name != "fp8":
            return
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        block_ids = {id(b) for b in blocks}
        inside = {name for name, m in model.named_modules() if id(m) in block_ids}

        def in_a_block(module: nn.Module, fqn: str) -> bool:
            dims_ok = isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            return dims_ok and any(fqn.startswith(prefix + ".") for prefix in inside)

        config = Float8LinearConfig(emulate=self.fp8_emulate)
        convert_to_float8_training(model, module_filter_fn=in_a_block, config=config)

    def cast_model(self, model: nn.Module) -> nn.Module:
        return model.to(torch.bfloat16) if self.name == "bf16-master" else model

    def build_optimizer(self, model: nn.Module,
                        build: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer; bf16-master builds the user's optimizer on fp32 master copies."""
        if self.name == "bf16-master":
            return MasterWeightOptimizer(model.parameters(), build)
        return build(model.parameters())

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type) if self.name == "fp16-mixed" else None

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        """The context the forward pass and the loss run in."""
        dtype = AUTOCAST_DTYPE.get(self.name)
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield

    # ------------------------------------------------------------------ bytes

    def estimate(self, shape: ModelShape, footprint: Footprint) -> Footprint:
        """The most bytes each model-state component reaches in a step, by precision.

        bf16-master: bf16 weights (2 B/param); gradients peak at 4 B/param when the bf16 gradients become
        fp32 master gradients for the optimizer step; the fp32 master copy (4 B/param) is added to the
        optimizer states (the optimizer-state strategy adds its moments, sized for fp32, on top).
        The others keep fp32 weights and gradients (autocast casts per op, counted as activations).
        """
        numel = shape.numel
        if self.name == "bf16-master":
            return footprint.with_(weights=2 * numel, gradients=4 * numel,
                                   optimizer_states=footprint.optimizer_states + 4 * numel)
        return footprint.with_(weights=4 * numel, gradients=4 * numel)
