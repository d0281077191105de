"""Attention in the activation trace as the CUDA kernel that will run it, not as this CPU's kernel.

Why: the trace runs under fake CPU tensors, so `F.scaled_dot_product_attention` picks a CPU kernel. With
attention dropout that is the math path, which keeps the attention probabilities and the dropout mask for
backward (several B x H x S x S tensors per layer); on a CUDA GPU the same call runs flash or
memory-efficient attention, which keep the output, the fp32 log-sum-exp and the RNG state only. A plan
for a GPU traced with CPU kernels is therefore pessimistic on activations and picks smaller micro-batches.

What this module does: `choose_kernel` answers which kernel torch would run for one call on a GPU of a
given compute capability, following torch's own dispatch (aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp: `select_sdp_backend` tries flash, then memory-efficient, then math;
`can_use_flash_attention` and `can_use_mem_efficient_attention` hold the rules restated in
`choose_kernel`'s docstring). `traced_attention` replaces `F.scaled_dot_product_attention` during a trace
by a function that calls that kernel's aten op (`aten._scaled_dot_product_flash_attention`,
`aten._scaled_dot_product_efficient_attention`, `aten._scaled_dot_product_attention_math`, reached through
memory/_torch_private.py as every private torch API memtrain uses), preprocessed
as torch's `scaled_dot_product_attention` preprocesses it for CUDA (attention.cpp: head dims padded to a
multiple of 8 for flash, a boolean mask made additive and padded to a multiple of 16 for
memory-efficient). Under `FakeTensorMode` those ops run their meta implementations
(torch/_meta_registrations.py) on the fake CPU tensors, and autograd records the ops' own backward nodes
(derivatives.yaml), so what the trace keeps for backward is what the CUDA kernel keeps: q, k, v, output,
log-sum-exp and the philox RNG state, no probabilities and no dropout mask; the backward runs the
backward ops' meta implementations, which give gradients of the right shapes. Eager attention (which
never calls SDPA) is untouched. On a CPU target, and on real tensors (which have no CUDA kernel here: the
planner's real-tensor rerun of a trace that fake tensors cannot run), the calls run this CPU's kernel and
are counted as such, so the plan says which attention the trace ran.

Not modelled: cuDNN attention, which recent torch prefers on sm90/sm100 when its cuDNN is newer than 9.15
and the dropout is a multiple of 1/16 (`check_prefer_cudnn_attention`, `check_cudnn_dropout`); it keeps
the same tensors for backward as flash (output, an fp32 log-sum-exp of B x H x S, the RNG state), so the
flash trace stands for it byte for byte. Data pointers are taken as aligned for memory-efficient
attention (`check_data_ptr_alignment_mem_efficient`): fake tensors have offsets but the projections that
feed attention start their views at multiples of the head width.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from memtrain.memory._torch_private import efficient_attention, flash_attention, math_attention

Kernel = Literal["flash", "efficient", "math"]
Capability = tuple[int, int]

SM50, SM80, SM86, SM89, SM120, SM121 = (5, 0), (8, 0), (8, 6), (8, 9), (12, 0), (12, 1)
FLASH_MAX_HEAD_DIM = 256
LOW_PRECISION = (torch.float16, torch.bfloat16)
MASK_ALIGNMENT = 16  # attention.cpp `preprocess_mask`: memory-efficient reads the bias in rows of 16
FLASH_HEAD_ALIGNMENT = 8  # attention.cpp `pad_last_dim<8>` before the flash kernel

DESCRIPTIONS = {
    "flash": "CUDA flash SDPA (output, log-sum-exp and RNG state kept for backward)",
    "efficient": "CUDA memory-efficient SDPA (output, log-sum-exp and RNG state kept for backward)",
    "math": "CUDA math SDPA (probabilities kept)",
    "cpu": "CPU SDPA",
}
EAGER = "no SDPA call (eager attention, if any: probabilities kept)"


@dataclass(frozen=True)
class SdpaCall:
    """What torch's kernel choice reads from one `scaled_dot_product_attention` call."""

    dtype: torch.dtype
    head_dim: int  # the query's last dimension
    key_dim: int
    value_dim: int
    q_len: int
    kv_len: int
    heads: int
    kv_heads: int
    has_mask: bool
    dropout: float
    is_causal: bool
    requires_grad: bool
    enable_gqa: bool = False
    last_dim_contiguous: bool = True

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout: float,
        is_causal: bool,
        enable_gqa: bool,
    ) -> SdpaCall:
        return cls(
            dtype=query.dtype,
            head_dim=int(query.shape[-1]),
            key_dim=int(key.shape[-1]),
            value_dim=int(value.shape[-1]),
            q_len=int(query.shape[-2]),
            kv_len=int(key.shape[-2]),
            heads=int(query.shape[-3]) if query.dim() > 2 else 1,
            kv_heads=int(key.shape[-3]) if key.dim() > 2 else 1,
            has_mask=attn_mask is not None,
            dropout=dropout,
            is_causal=is_causal,
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
            enable_gqa=enable_gqa,
            last_dim_contiguous=all(t.stride(-1) == 1 for t in (query, key, value)),
        )


def choose_kernel(call: SdpaCall, capability: Capability) -> Kernel:
    """The kernel torch runs `call` with on a CUDA GPU of compute capability `capability`, with the
    default priority order flash, memory-efficient, math (sdp_utils.cpp `select_sdp_backend`).

    Flash (`can_use_flash_attention`): no `attn_mask` (`check_for_attn_mask`); q, k, v of one head dim, at
    most 256 (`check_head_dim_size_flash`; other sizes are padded to a multiple of 8 by the caller);
    sm80 to sm121 (`check_flash_attention_hardware_support`); on sm86-sm89 and sm120-sm121, training with a
    head dim in (192, 224], or in (224, 256] with dropout, is refused
    (`check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120`); `is_causal` only with equal
    query and key lengths (`check_flash_causal_non_square_seqlens`); fp16 or bf16
    (`check_dtypes_low_precision`); grouped-query heads allowed with `enable_gqa`; the last dim of
    every input of stride 1, singleton dims aside.

    Memory-efficient (`can_use_mem_efficient_attention`): sm50 to sm121
    (`check_mem_efficient_hardware_support`); masks and dropout allowed; q and k of one head dim, q's and
    v's head dims multiples of the GEMM alignment (`check_head_dim_size_mem_efficient`,
    `minimum_gemm_alignment`: 8 for fp16/bf16 and 4 for fp32 from sm80, 8 for fp16 and 1 for fp32 on
    sm70-sm75, 1 below); fp16, fp32 and, from sm80, bf16; last dims of stride 1; as many key/value heads
    as query heads (newer sources let it take grouped heads, but this torch's meta backward of
    `_scaled_dot_product_efficient_attention` gives k and v gradients the query's head count, so grouped
    heads go to math, as in torch releases before that change).

    Math: everything else.
    """
    if _can_use_flash(call, capability):
        return "flash"
    if _can_use_efficient(call, capability):
        return "efficient"
    return "math"


def _can_use_flash(call: SdpaCall, capability: Capability) -> bool:
    hd = call.head_dim
    head_dims_ok = 0 < hd <= FLASH_MAX_HEAD_DIM and hd == call.key_dim == call.value_dim
    consumer = SM86 <= capability <= SM89 or SM120 <= capability <= SM121
    training_ok = not (call.requires_grad and consumer) or hd <= 192 or (call.dropout == 0.0 and hd > 224)
    return (
        not call.has_mask
        and head_dims_ok
        and SM80 <= capability <= SM121
        and training_ok
        and not (call.is_causal and call.q_len != call.kv_len)
        and call.dtype in LOW_PRECISION
        and _heads_ok(call)
        and call.last_dim_contiguous
    )


def _can_use_efficient(call: SdpaCall, capability: Capability) -> bool:
    dtypes = (
        (torch.float16, torch.float32, torch.bfloat16)
        if capability >= SM80
        else (torch.float16, torch.float32)
    )
    alignment = _gemm_alignment(call.dtype, capability)
    hd, vd = call.head_dim, call.value_dim
    return (
        SM50 <= capability <= SM121
        and hd > 0
        and vd > 0
        and hd == call.key_dim
        and hd % alignment == 0
        and vd % alignment == 0
        and call.dtype in dtypes
        and call.heads == call.kv_heads
        and call.last_dim_contiguous
    )


def _gemm_alignment(dtype: torch.dtype, capability: Capability) -> int:
    """sdp_utils.cpp `minimum_gemm_alignment`: tensor cores from sm80 (sm70 for half types) want 128-bit
    rows; sm80 and newer want at least 4 elements."""
    half = dtype in LOW_PRECISION
    tensor_cores = capability >= SM80 or (capability >= (7, 0) and half)
    alignment = 4 if capability >= SM80 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _heads_ok(call: SdpaCall) -> bool:
    """`check_batch_size_and_num_heads_dense`: equal heads, or with `enable_gqa` query heads a multiple of
    the key/value heads."""
    if call.heads == call.kv_heads:
        return True
    return call.enable_gqa and call.kv_heads > 0 and call.heads % call.kv_heads == 0


class KernelLog:
    """Which attention kernels a trace ran, counted per call."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def describe(self) -> str:
        """E.g. "CUDA flash SDPA (...)"; `EAGER` when SDPA was never called (eager attention
        or none at all)."""
        if not self.calls:
            return EAGER
        return " + ".join(DESCRIPTIONS[k] for k in sorted(self.calls))


@contextlib.contextmanager
def traced_attention(capability: Capability | None) -> Iterator[KernelLog]:
    """While open, `F.scaled_dot_product_attention` runs the kernel a CUDA GPU of `capability` would run
    (see the module docstring); with None (a CPU target) it runs as before and is only counted."""
    log = KernelLog()
    original = F.scaled_dot_product_attention

    def cpu(*args: Any, **kwargs: Any) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # inside a compiled region, counting would break its graph
            log.calls["cpu"] += 1
        return original(*args, **kwargs)

    def cuda(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        assert capability is not None
        if query.untyped_storage().device.type != "meta":  # real tensors (a real-tensor rerun of the trace):
            return cpu(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
        call = SdpaCall.of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        kernel = choose_kernel(call, capability)
        log.calls[kernel] += 1
        with torch.autocast(query.device.type, enabled=False):  # autocast casts once, at the SDPA call
            if kernel == "flash":
                return _flash(query, key, value, dropout_p, is_causal, scale)
            if kernel == "efficient":
                return _efficient(
                    query, key, value, attn_mask, dropout_p, is_causal, scale, call.requires_grad
                )
            return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    F.scaled_dot_product_attention = cpu if capability is None else cuda  # type: ignore[assignment]
    try:
        yield log
    finally:
        F.scaled_dot_product_attention = original


def _autocast(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """CUDA autocast runs SDPA in the autocast dtype: floating inputs (a float mask too) are cast first
    (and the casts are what the kernel keeps). The trace's autocast is on the fake tensors' device."""
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(device)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return cast(query), cast(key), cast(value), None if attn_mask is None else cast(attn_mask)


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """attention.cpp's flash case: head dims padded to a multiple of 8 (the padded copies are what the
    kernel keeps), the scale taken from the unpadded head dim, the output cut back."""
    head_dim = query.shape[-1]
    pad = -head_dim % FLASH_HEAD_ALIGNMENT
    if pad:
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
    scale = scale if scale is not None else head_dim**-0.5
    out = flash_attention(query, key, value, dropout_p, is_causal, scale)
    return out[..., :head_dim] if pad else out


def _efficient(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    requires_grad: bool,
) -> torch.Tensor:
    """attention.cpp's memory-efficient case: a boolean mask becomes an additive one in the query's dtype
    (`convert_boolean_attn_mask`), expanded to B x H x L x S and padded to a multiple of 16 keys
    (`preprocess_mask`); the log-sum-exp is computed when backward needs it (`should_compute_logsumexp`)."""
    bias = None
    if attn_mask is not None:
        bias = attn_mask
        if bias.dtype == torch.bool:
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(bias.logical_not(), float("-inf"))
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        kv_len = bias.shape[-1]
        if kv_len % MASK_ALIGNMENT:
            bias = F.pad(bias, (0, -kv_len % MASK_ALIGNMENT))[..., :kv_len]
        elif any(bias.stride(d) % MASK_ALIGNMENT for d in range(3)):
            bias = bias.contiguous()
    return efficient_attention(query, key, value, bias, requires_grad, dropout_p, is_causal, scale)
