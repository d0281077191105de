"""The loss: how the cross-entropy over the output head is computed.

Why a strategy: at a large vocabulary the head's fp32 logits, the log-softmax autograd keeps and their
gradient are the largest activations of a step (a 128k vocabulary at 8k tokens per micro-batch: 4 GiB
per copy). `chunked` computes the head and the loss a chunk of `chunk_tokens` tokens at a time and
recomputes each chunk's logits in backward (`torch.utils.checkpoint`), so only the hidden states and one
chunk's logits live at once. The math is the same (per-token losses summed in fp32), so it is exact up to
the order of the sum; the price is one more head forward in backward (2·tokens·hidden·vocab FLOPs), which
the step-time model charges, so the planner keeps `standard` when memory is to spare.

How it reaches the loss: `apply` (called by `apply_strategies`) binds the strategy to the model;
`bound_loss(model)` finds it (through DDP / DeepSpeed wrappers too). A trainer's loss that asks for it runs
the model inside `binding.deferring_head()`, where `chunked` makes the output head pass its input through
(the model's `logits` are then the hidden states), and `binding(output, labels, ignore_index)` applies the
head chunk by chunk. A custom trainer (`--trainer`) that computes its own loss from `model(...).logits`
ignores the binding: `chunked` then changes nothing, and the planner, which traces that real loss, sees no
saving, only the recompute's cost, and does not prefer it.

`fused` (fused_cross_entropy.py) computes the gradients in forward instead of recomputing: no second head
forward, at the price of keeping the hidden states' gradient and a head-sized gradient accumulator from
forward to backward. Liger-Kernel's kernel on CUDA when installed (`memtrain[fused]`), the same algorithm
in PyTorch elsewhere. Which of the three is best depends on the vocabulary, the width and the tokens per
micro-batch, so the planner traces each and picks (`strategies.loss: auto`).

Refused (`chunked` and `fused`, both apply the bare head): a head that is not a plain `nn.Linear` (a
LoRA-adapted or quantised head), DeepSpeed ZeRO-3 (which re-partitions the head's weight after its
forward), and models whose logits are not `head(hidden)` (the trainer's own check: the built-in one
refuses Gemma-2's soft-capping, Cohere's logit scale...).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.errors import Unsupported
from memtrain.strategies.fused_cross_entropy import fused_linear_cross_entropy
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy, option
from memtrain.strategies.sharding import Sharding
from memtrain.strategies.tensor_parallel import check_loss, whole_value

BINDING = "memtrain_loss"  # the model attribute `apply` sets


@dataclass(frozen=True)
class Loss(Strategy):
    """`standard`: `F.cross_entropy` over the model's full fp32 logits.

    Facts the planner and the trainer read: `recomputes_head` (one more head forward per micro-step in
    backward), `applies_bare_head` (the loss applies the head itself, so logits must be `head(hidden)`)."""

    kind: ClassVar[str] = "loss"
    name: ClassVar[str] = "standard"
    recomputes_head: ClassVar[bool] = False
    applies_bare_head: ClassVar[bool] = False

    def check(self, facts: DeviceFacts) -> None:
        check_loss(self.name, facts.shape.tp)

    def check_sharding(self, sharding: Sharding) -> None:
        """`Unsupported` when this loss cannot run with `sharding`."""

    def apply(self, model: nn.Module, head: nn.Module | None) -> None:
        """Bind this loss to `model` (its output head `head`, None for a model without one)."""
        setattr(model, BINDING, BoundLoss(self, None))


LOSS: Registry[Loss] = Registry(
    "loss",
    Loss,
    RecipeKey(
        "strategies",
        "loss",
        "standard",
        "How the head and the cross-entropy run: standard, chunked (no full fp32 logits) or fused (the "
        "head's gradients chunk by chunk in forward).",
        changes_trajectory=False,
    ),
)
LOSS.register(Loss)


@LOSS.register
@dataclass(frozen=True)
class Chunked(Loss):
    """`chunked`: the head and the loss `chunk_tokens` tokens at a time, each chunk's logits recomputed
    in backward."""

    name: ClassVar[str] = "chunked"
    recomputes_head: ClassVar[bool] = True
    applies_bare_head: ClassVar[bool] = True
    # one chunk's fp32 logits at a 128k vocabulary: 512 MiB; 1024-row matmuls still fill a GPU
    chunk_tokens: int = option(
        1024,
        doc="Tokens per chunk of the head and the loss when loss is 'chunked' or 'fused'.",
        changes_trajectory=False,
        gt=0,
    )

    def check_sharding(self, sharding: Sharding) -> None:
        if sharding.name == "zero3" and sharding.backend == "deepspeed":
            raise Unsupported(
                f"strategies.loss: {self.name} reads the head's weight after the model's forward, which "
                "DeepSpeed ZeRO-3 has re-partitioned by then; use strategies.loss=standard or "
                "strategies.sharding_backend=fsdp2"
            )

    def apply(self, model: nn.Module, head: nn.Module | None) -> None:
        if type(head) is not nn.Linear:
            found = "none" if head is None else type(head).__name__
            raise Unsupported(
                f"strategies.loss: {self.name} needs the output head to be a plain nn.Linear (found "
                f"{found}); use strategies.loss=standard"
            )
        if self.chunk_tokens < 1:
            raise Unsupported(f"strategies.loss_chunk_tokens: must be positive (got {self.chunk_tokens})")
        setattr(model, BINDING, BoundLoss(self, head))

    def head_loss(
        self, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        """The fp32 sum of the token losses of `head(hidden)` against `labels`."""
        return chunked_cross_entropy(hidden, head.weight, head.bias, labels, ignore_index, self.chunk_tokens)


@LOSS.register
@dataclass(frozen=True)
class Fused(Chunked):
    """`fused`: the head, the loss and their gradients in one chunked pass in forward (no recompute);
    Liger-Kernel's kernel on CUDA when installed."""

    name: ClassVar[str] = "fused"
    recomputes_head: ClassVar[bool] = False

    def head_loss(
        self, hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        return fused_linear_cross_entropy(
            hidden, head.weight, head.bias, labels, ignore_index, self.chunk_tokens
        )


@dataclass(frozen=True)
class BoundLoss:
    """A model's loss: the strategy, and the head whose forward `chunked` deferred to the loss."""

    strategy: Loss
    head: nn.Linear | None

    @contextlib.contextmanager
    def deferring_head(self) -> Iterator[None]:
        """Run the model in this: under `chunked` its output head passes the hidden states through."""
        if self.head is None:
            yield
            return
        self.head.forward = types.MethodType(_pass_through, self.head)  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.head.forward

    def __call__(self, output: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """The fp32 sum of the per-token losses over `labels` (`ignore_index` skipped). `output`: the
        model's `logits` (the hidden states under `chunked`), [..., vocab or hidden]."""
        if (
            self.head is None
        ):  # logits split by vocabulary (tensor parallel): a replicated DTensor, made local
            return whole_value(
                F.cross_entropy(
                    output.float().reshape(-1, output.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=ignore_index,
                    reduction="sum",
                )
            )
        assert isinstance(self.strategy, Chunked)
        return self.strategy.head_loss(output, self.head, labels, ignore_index)


def bound_loss(model: nn.Module) -> BoundLoss:
    """The loss `apply` bound to `model` or to the model a wrapper holds (`standard` when none was)."""
    found = next((m.__dict__[BINDING] for m in model.modules() if BINDING in m.__dict__), None)
    return found if isinstance(found, BoundLoss) else BoundLoss(Loss(), None)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_tokens: int,
) -> torch.Tensor:
    """`cross_entropy(linear(hidden, weight, bias).float(), labels, reduction="sum")`, `chunk_tokens`
    tokens at a time, each chunk's logits recomputed in backward instead of kept."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(
            _chunk_loss, flat[start:end], weight, bias, targets[start:end], ignore_index, use_reentrant=False
        )
    return total


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def _pass_through(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden
