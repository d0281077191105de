"""Mixture-of-experts grouped matmuls in the fake-tensor trace, in the dtypes the real CPU kernel trains.

Why: transformers' grouped-mm experts (Mixtral, Qwen2-MoE, ...) call `torch._grouped_mm` (directly or
through `F.grouped_mm`). Its meta kernel, which is what runs on fake tensors, accepts bf16 inputs only and
raises for fp32, while the real CPU kernel trains fp32. Without help the fake trace of every fp32 MoE plan
fails and the planner falls back to a real-tensor trace of a small clone (trace_fallback.py), which is
bounded: a large MoE model would be reported Unsupported.

What this module does: `traced_grouped_mm` replaces `torch._grouped_mm` during a trace by a function that
sends fake inputs of a dtype the meta kernel refuses through `_GroupedMm`, a shim that does what the real
kernel does to memory: a new output of the inputs' dtype and the kernel's shape (the shape rules of torch's
meta kernel, `_create_grouped_mm_output_tensor`), saved for backward what `GroupedMmBackward0` saves
(`mat_a`, `mat_b`, `offs`) and a backward that makes one gradient per input that needs one, of the
input's shape, dtype and layout. The output is made by a matmul (`aten.mm` of empty operands, autocast
off), because selective recompute keeps matmul outputs by their op (strategies/checkpointing.py) and the
real `_grouped_mm` is one: made by `new_empty` it was recomputed in the trace and kept in the real run
(every grouped-mm MoE family 9-17% under with selective recompute), and an mm under bf16 autocast would
have made it bf16 where autocast leaves the real op fp32. Real tensors, bf16 inputs, a bias or another `out_dtype` go to torch's op
unchanged (the op and the swap are in memory/_torch_private.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from memtrain.memory._torch_private import grouped_mm, grouped_mm_replaced, is_fake

META_DTYPES = (torch.bfloat16,)  # what the meta kernel of `aten._grouped_mm` accepts


def output_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The shape `aten._grouped_mm(mat_a, mat_b, offs)` returns (2-D operands are cut into groups by
    `offs`: 2-D x 3-D is the experts' forward, 2-D x 2-D and 3-D x 2-D their backward)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        if offs is None:
            raise ValueError("grouped_mm of two 2-D operands needs `offs`")
        return (offs.size(0), mat_a.size(0), mat_b.size(1))
    if mat_a.dim() == 2:
        return (mat_a.size(0), mat_b.size(-1))
    if mat_b.dim() == 2:
        return (mat_a.size(1), mat_b.size(1))
    return (mat_a.size(0), mat_a.size(1), mat_b.size(-1))


class _GroupedMm(torch.autograd.Function):
    """`aten._grouped_mm` as its real kernel and `GroupedMmBackward0` use memory (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(mat_a, mat_b, offs)
        shape = output_shape(mat_a, mat_b, offs)
        rows = math.prod(shape[:-1])
        with torch.autocast(mat_a.device.type, enabled=False):  # a matmul to selective recompute's policy
            return torch.mm(mat_a.new_empty(rows, 0), mat_a.new_empty(0, shape[-1])).view(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        mat_a, mat_b, _ = ctx.saved_tensors
        # In the inputs' layouts, as the real backward makes them: the experts' `weight.transpose(-2, -1)`
        # gets a transposed gradient, which the weight's gradient accumulation then takes without a copy.
        grad_a = torch.empty_like(mat_a) if ctx.needs_input_grad[0] else None
        grad_b = torch.empty_like(mat_b) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def needs_shim(mat_a: torch.Tensor, mat_b: torch.Tensor) -> bool:
    """Fake inputs whose dtype the meta kernel refuses (module docstring)."""
    return (is_fake(mat_a) or is_fake(mat_b)) and mat_a.dtype not in META_DTYPES


@contextlib.contextmanager
def traced_grouped_mm() -> Iterator[None]:
    """While open, `torch._grouped_mm` on fake inputs of a dtype the meta kernel refuses runs `_GroupedMm`;
    every other call runs torch's op."""

    def traced(
        mat_a: torch.Tensor,
        mat_b: torch.Tensor,
        offs: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if bias is None and out_dtype in (None, mat_a.dtype) and needs_shim(mat_a, mat_b):
            result: torch.Tensor = _GroupedMm.apply(mat_a, mat_b, offs)
            return result
        return grouped_mm(mat_a, mat_b, offs, bias, out_dtype)

    with grouped_mm_replaced(traced):
        yield
