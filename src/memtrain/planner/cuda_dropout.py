"""Dropout in the activation trace as CUDA runs it: torch's fused dropout, which keeps a bool mask.

Why: the trace runs under fake CPU tensors, so `F.dropout` takes the CPU route (Dropout.cpp `_dropout`),
which multiplies the input by a noise tensor of the input's dtype and keeps that noise for backward: 4
bytes per element in fp32, 2 in bf16. On a CUDA GPU the same call runs the fused kernel
(`is_fused_kernel_acceptable`: CUDA, 0 < p < 1, a non-empty input), `aten.native_dropout`, whose
backward (`native_dropout_backward`) keeps a bool mask: 1 byte per element. Every `nn.Dropout` goes
through `F.dropout` (GPT-2's embedding, residual and MLP dropouts, eager attention's dropout of the
probabilities), so a CUDA plan traced with the CPU route overcounts each of those masks.

What this module does: `traced_dropout` replaces `torch.nn.functional.dropout` during a trace for a CUDA
target by a function that runs `aten.native_dropout` (through memory/_torch_private.py) where CUDA would
run the fused kernel; under `FakeTensorMode` it runs its meta implementation and autograd records
`NativeDropoutBackward0`, so the trace keeps the bool mask. Everything else takes `F.dropout` as before:
evaluation (`training=False`) and p = 0 return the input, p = 1 and in-place dropout (`dropout_`, never
fused) take the CPU route, as they do on CUDA. On real tensors (the planner's real-tensor rerun of a trace)
the CPU's own `native_dropout` runs, which keeps the same bool mask. A CPU target is traced unchanged.

Not modelled: the dropout inside the math SDPA kernel (`aten._scaled_dot_product_attention_math` calls
`at::dropout` in C++, out of Python's reach), which a CUDA target runs only where neither flash nor
memory-efficient attention takes the call (attention_kernels.py `choose_kernel`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memtrain.memory._torch_private import native_dropout
from memtrain.planner.attention_kernels import Capability


@contextlib.contextmanager
def traced_dropout(capability: Capability | None) -> Iterator[None]:
    """While open, `F.dropout` runs as on a CUDA GPU (see the module docstring); with None (a CPU target)
    nothing changes."""
    if capability is None:
        yield
        return
    original = F.dropout

    def cuda(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0:
            return native_dropout(input, p)
        return original(input, p, training, inplace)

    F.dropout = cuda  # type: ignore[assignment]
    try:
        yield
    finally:
        F.dropout = original
