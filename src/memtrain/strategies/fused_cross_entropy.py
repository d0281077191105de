"""Fused linear cross-entropy: the head, the loss and their gradients in one pass, chunk by chunk.

Why: `chunked` (loss.py) keeps one chunk's logits at a time but pays for it with a second head forward in
backward. The fused form (Liger-Kernel's "fused linear cross-entropy") needs no recompute: while it walks
the chunks in forward it already computes each chunk's gradient with respect to the hidden states and the
head's weight, keeps those, and backward only scales them by the incoming gradient, in place (no second
copy of either, as in Liger's kernel). What it keeps is
therefore the gradient of the hidden states (their size and dtype) and one head-weight-sized gradient
accumulator, never more than one chunk of logits: at a large vocabulary far less than `standard`, and
one head forward less than `chunked`.

Two implementations of the same algorithm, chosen at run time:

- on CUDA with `liger-kernel` installed (the optional extra `memtrain[fused]`), its Triton kernel
  `LigerFusedLinearCrossEntropyLoss` (maintained, faster; it picks its own chunk size);
- everywhere else, `FusedLinearCrossEntropy` below in plain PyTorch (`chunk_tokens` tokens per chunk).
  The planner's trace runs this one on fake tensors: it keeps what Liger's kernel keeps (the hidden
  states' gradient in their dtype, a weight-dtype accumulator for the head's gradient), so the traced
  memory is the kernel's up to the size of one chunk's transient logits.

The result is `cross_entropy(linear(hidden, weight, bias).float(), labels, reduction="sum")`: the same per
token losses summed in fp32, the same gradients up to the order of the sums. Under autocast the matmuls
run in the autocast dtype, as `standard`'s head does.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F


def liger_available(device: torch.device) -> bool:
    """Whether Liger-Kernel's fused kernel can run for tensors on `device`."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int,
) -> torch.Tensor:
    """The fp32 sum of the token losses of `linear(hidden, weight, bias)` against `labels`, gradients
    computed in forward (Liger's kernel on CUDA when installed, else chunk by chunk in PyTorch)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    if liger_available(flat.device):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction="sum")(
            weight, flat, targets, bias
        )
        return (loss[0] if isinstance(loss, tuple) else loss).float()
    result: torch.Tensor = FusedLinearCrossEntropy.apply(
        flat, weight, bias, targets, ignore_index, chunk_tokens
    )
    return result


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and every gradient; backward scales the kept gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_tokens: int,
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = hidden[start : start + chunk_tokens]
            targets = labels[start : start + chunk_tokens]
            logits = F.linear(rows, weight, bias).float()
            keep = targets != ignore_index
            safe = torch.where(keep, targets, 0)
            log_norm = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            total = total + ((log_norm - picked) * keep).sum()
            # d loss / d logits = softmax - onehot on the rows with a label, 0 elsewhere (in place: one
            # chunk of logits at a time)
            grad_logits = logits.sub_(log_norm.unsqueeze(1)).exp_()
            grad_logits[torch.arange(len(safe), device=safe.device), safe] -= 1.0
            grad_logits.mul_(keep.unsqueeze(1))
            compute = grad_logits.to(_matmul_dtype(rows))
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_tokens] = compute @ weight.to(compute.dtype)
            if grad_weight is not None:  # accumulated in place: no head-sized product per chunk
                if grad_weight.dtype == compute.dtype:
                    grad_weight.addmm_(compute.t(), rows.to(compute.dtype))
                else:  # autocast: the product in the compute dtype, added to the weight-dtype accumulator
                    grad_weight.add_(compute.t() @ rows.to(compute.dtype))
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0).to(grad_bias.dtype)
            del logits, grad_logits, compute
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The kept gradients scaled in place and handed on, as Liger's kernel does: they are this
        function's own (nothing else reads them), so a scaled copy would hold a second head-sized gradient
        (and a second hidden-states gradient) at the backward's peak for nothing. In place in the kept
        dtype is what `(grad * scale).to(grad.dtype)` computed: a 0-dim fp32 factor does not promote a bf16
        tensor, so the product was already rounded to the kept dtype; scaling by 1.0 is exact."""
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_output.float()
        for grad in (grad_hidden, grad_weight, grad_bias):
            if grad is not None:
                grad.mul_(scale)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _matmul_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype autocast runs the head's matmuls in (the rows' own dtype outside autocast)."""
    device = rows.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
