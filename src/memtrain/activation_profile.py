"""Measure what autograd keeps for backward, block by block: the input of every checkpointing estimate.

Why a trace and not a formula: the textbook per-layer constants assume GPT-style attention, a 4h MLP and
dropout; SwiGLU, GQA, fused attention kernels and the fp32 loss all change them. One forward of the real
model, watched three ways, gives the numbers each checkpointing mode needs:

- `saved_tensors_hooks` see every tensor autograd saves, at the moment it is saved;
- forward pre/post hooks on the blocks say which block is running, and what each block received;
- a `TorchDispatchMode` sees every op's outputs, so it knows which storages the forward created (as opposed
  to parameters, buffers and the batch) and which op produced each one (matmul-like or not).

Bytes are counted per storage, once: a view, a reshape or the same tensor saved by three ops (the q, k, v
projections all save the normalised input) is one allocation. Storages the forward did not create —
parameters and the views of them that matmuls save, buffers, token ids — are not activations.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memtrain.footprint import ActivationProfile

_MATMUL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "_addmm_activation",
    "_int_mm",
    "_scaled_mm",
    "_grouped_mm",
    "_scaled_grouped_mm",
    "linear",
    "matmul",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
MATMUL_OPS: frozenset[Any] = frozenset(
    packet for packet in (getattr(torch.ops.aten, name, None) for name in _MATMUL_NAMES) if packet is not None
)
"""aten op packets whose outputs count as matmul outputs: what `selective` checkpointing keeps. Ops missing
from an older torch are skipped. `linear` and `matmul` usually decompose into mm/bmm before dispatch."""


def is_matmul(op: Any) -> bool:
    """Whether an aten op (an OpOverload, as dispatch modes see it) is matmul-like."""
    return getattr(op, "overloadpacket", None) in MATMUL_OPS


def profile_activations(
    model: nn.Module, blocks: Sequence[nn.Module], run_step: Callable[[], torch.Tensor]
) -> ActivationProfile:
    """Saved-for-backward bytes of one forward (`run_step` runs it and returns the loss), per block.

    `blocks` must be in forward order and not checkpointed. After measuring, the loss is backpropagated (so
    gradients accumulate in `.grad`, as in any step) and the graph is freed.
    """
    probe = _Probe(model, list(blocks))
    with probe:
        loss = run_step()
    loss.backward()
    global LAST
    LAST = probe
    return probe.profile()


@dataclass
class _Made:
    """A storage the forward created: how big, inside which block (None: outside), by a matmul-like op."""

    nbytes: int
    block: int | None
    matmul: bool


class _Probe(TorchDispatchMode):
    def __init__(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self._model = model
        self._blocks = blocks
        self._block: int | None = None
        self._made: dict[int, _Made] = {}  # id(storage) -> what made it, while the storage lives
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._saved: dict[int, tuple[int | None, _Made]] = {}  # id(storage) -> (block that saved it first, it)
        self._inputs: set[int] = set()  # live storages some block already received as input
        self._block_inputs = [0] * len(blocks)
        self._block_made: list[list[_Made]] = [[] for _ in blocks]
        self._weights: set[int] = set()
        self._handles: list[Any] = []
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> _Probe:
        self._weights = {id(t.untyped_storage()) for t in (*self._model.parameters(), *self._model.buffers())}
        for index, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._enter_block(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._leave_block))
        self._hooks.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def profile(self) -> ActivationProfile:
        count = len(self._blocks)
        per_block = [0] * count
        outside = 0
        for block, made in self._saved.values():
            if block is None:
                outside += made.nbytes
            else:
                per_block[block] += made.nbytes
        matmul = [sum(m.nbytes for m in made if m.matmul) for made in self._block_made]
        return ActivationProfile(
            per_block=tuple(per_block),
            block_inputs=tuple(self._block_inputs),
            matmul_outputs=tuple(matmul),
            outside_blocks=outside,
        )

    def _enter_block(self, index: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._block = index
            for tensor in _tensors((args, kwargs)):
                key = id(tensor.untyped_storage())
                if key in self._made and key not in self._inputs:
                    self._inputs.add(key)
                    self._block_inputs[index] += self._made[key].nbytes

        return hook

    def _leave_block(self, _module: nn.Module, _args: object, _output: object) -> None:
        self._block = None

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: set[int] | None = None
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = id(storage)
            if storage.nbytes() == 0 or key in self._made or key in self._weights:
                continue
            if inputs is None:
                inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
            if key in inputs:  # a view of (or in-place op on) a storage the forward did not create
                continue
            made = _Made(storage.nbytes(), self._block, is_matmul(func))
            self.live += made.nbytes
            self.peak = max(self.peak, self.live)
            self._made[key] = made
            self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._forget(key))
            if made.block is not None:
                self._block_made[made.block].append(made)
        return out

    def _forget(self, key: int) -> None:
        if key in self._made: self.live -= self._made[key].nbytes
        self._made.pop(key, None)
        self._refs.pop(key, None)
        self._inputs.discard(key)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = id(tensor.untyped_storage())
        made = self._made.get(key)
        if made is not None and key not in self._saved:
            self._saved[key] = (self._block, made)
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _tensors(tree: Any) -> Iterable[torch.Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))
