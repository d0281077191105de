"""Measure what a forward keeps for backward, block by block: the input of every checkpointing estimate.

Why a trace and not a formula: the textbook per-layer constants assume GPT-style attention, a 4h MLP and
dropout; SwiGLU, GQA, fused attention kernels, the fp32 loss and the way a block's Python code holds its
intermediates all change them. One forward of the real model, watched three ways, gives the numbers each
checkpointing mode needs:

- a `TorchDispatchMode` sees every op's outputs: which storages the forward created (as opposed to
  parameters, buffers and the batch), which op made each one (matmul-like or not), and, with a weak
  reference per storage, how many of those bytes are alive after every op;
- forward pre/post hooks on the blocks say which block is running and what each block received;
- `saved_tensors_hooks` see every tensor autograd saves, at the moment it is saved.

Bytes are counted per storage, once: a view, a reshape or one tensor saved by three ops (the q, k, v
projections all save the normalised input) is one allocation. Storages the forward did not create —
parameters and the transposed views of them that matmuls save, buffers, token ids — are not activations.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from memtrain.memory._torch_private import TorchDispatchMode, tree_leaves
from memtrain.memory.footprint import ActivationProfile

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
    """Activation bytes of one forward (`run_step` runs it and returns the loss), per block.

    `blocks` must be in forward order and not checkpointed. Fields, in bytes:

    - per_block: storages the forward created that autograd saves, by the block that saves them first;
    - block_inputs: created storages each block receives (positional or keyword, nested too), each
      counted at the first block that receives it (the rotary cos/sin every block gets: block 0);
    - matmul_outputs: outputs of matmul-like ops made inside each block — all of them, saved or not,
      because that is what selective checkpointing keeps;
    - outside_blocks: what the forward holds beyond the blocks' saved bytes once the blocks have run, at
      its peak: the last block's output, the head's and loss's saved tensors, and transients alive with
      them (the logits while the loss runs);
    - block_peaks, recompute_peaks: see `memtrain.memory.footprint.ActivationProfile`.

    After measuring, the loss is backpropagated (gradients accumulate in `.grad`, as in any step) and the
    graph is freed.
    """
    owned = {id(m) for m in model.modules()}
    if not all(id(block) in owned for block in blocks):
        raise ValueError("profile_activations: every block must be a submodule of the model")
    probe = _Probe(list(blocks))
    with probe:
        loss = run_step()
    loss.backward()
    return probe.trace()


class _Made:
    """A storage the forward created: its size, the block that made it (None: outside), the op kind."""

    __slots__ = ("nbytes", "block", "matmul", "saved_in_block")

    def __init__(self, nbytes: int, block: int | None, matmul: bool) -> None:
        self.nbytes = nbytes
        self.block = block
        self.matmul = matmul
        self.saved_in_block: int | None = None


class _Probe(TorchDispatchMode):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        count = len(blocks)
        self._blocks = blocks
        self._block: int | None = None
        self._blocks_seen = False
        self._made: dict[int, _Made] = {}  # id(storage) -> record, while the storage lives
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._inputs: set[int] = set()  # live storages some block already received
        self._live = 0
        self._live_in = [0] * count  # live bytes made by each block
        self._live_saved_in_blocks = 0
        self._per_block = [0] * count
        self._block_inputs = [0] * count
        self._matmul = [0] * count
        self._block_peaks = [0] * count
        self._recompute_peaks = [0] * count
        self._outside = 0
        self._handles: list[Any] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> _Probe:
        for index, block in enumerate(self._blocks):
            self._handles.append(block.register_forward_pre_hook(self._entering(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._leave))
        self._hooks.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def trace(self) -> ActivationProfile:
        return ActivationProfile(
            per_block=tuple(self._per_block),
            block_inputs=tuple(self._block_inputs),
            matmul_outputs=tuple(self._matmul),
            outside_blocks=self._outside,
            block_peaks=tuple(self._block_peaks),
            recompute_peaks=tuple(self._recompute_peaks),
        )

    def _entering(self, index: int) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._block = index
            self._blocks_seen = True
            for tensor in _tensors((args, kwargs)):
                key = id(tensor.untyped_storage())
                made = self._made.get(key)
                if made is not None and key not in self._inputs:
                    self._inputs.add(key)
                    self._block_inputs[index] += made.nbytes

        return hook

    def _leave(self, _module: nn.Module, _args: object, _output: object) -> None:
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
            if storage.nbytes() == 0 or key in self._made:
                continue
            if inputs is None:
                inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
            if key in inputs:  # a view of (or in-place op on) a storage the forward did not create
                continue
            made = _Made(storage.nbytes(), self._block, is_matmul(func))
            self._made[key] = made
            self._refs[key] = weakref.ref(storage, functools.partial(self._forget_ref, key))
            self._live += made.nbytes
            if made.block is not None:
                self._live_in[made.block] += made.nbytes
                if made.matmul:
                    self._matmul[made.block] += made.nbytes
        if self._block is not None:
            block = self._block
            self._block_peaks[block] = max(self._block_peaks[block], self._live_in[block])
        elif self._blocks_seen:
            self._outside = max(self._outside, self._live - self._live_saved_in_blocks)
        return out

    def _forget_ref(self, key: int, _ref: object) -> None:
        self._forget(key)

    def _forget(self, key: int) -> None:
        made = self._made.pop(key, None)
        self._refs.pop(key, None)
        self._inputs.discard(key)
        if made is None:
            return
        self._live -= made.nbytes
        if made.block is not None:
            self._live_in[made.block] -= made.nbytes
        if made.saved_in_block is not None:
            self._live_saved_in_blocks -= made.nbytes

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        block = self._block
        if block is None:
            return tensor
        # A recompute stops once the block's last saved tensor exists again (non-reentrant checkpoint's
        # early stop), so the block's peak up to its last save is what a recompute re-creates.
        self._recompute_peaks[block] = self._block_peaks[block]
        made = self._made.get(id(tensor.untyped_storage()))
        if made is not None and made.saved_in_block is None:
            made.saved_in_block = block
            self._per_block[block] += made.nbytes
            self._live_saved_in_blocks += made.nbytes
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _tensors(tree: Any) -> Iterable[torch.Tensor]:
    return (leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))
