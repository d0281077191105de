"""Numerical precision of the forward/backward pass.

`fp32`: nothing changes. `bf16-mixed`: parameters, gradients and optimizer states stay fp32; matmuls
run in bf16 under autocast. Precision changes numerics, so the planner only picks among the names a
recipe allows (the memory strategies issue adds bf16-master, fp16-mixed and fp8).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from memtrain.errors import Unsupported


@dataclass(frozen=True)
class Precision:
    name: str

    def check(self, device: torch.device) -> None:
        if self.name == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise Unsupported(
                "strategies.precision: bf16-mixed needs a GPU with bf16 support (compute capability >= 8.0); "
                "use fp32"
            )

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        """The context the forward pass and the loss run in."""
        if self.name == "bf16-mixed":
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                yield
        else:
            yield
