"""Activation checkpointing: give up compute (or host memory) to keep fewer activation bytes on the device.

Activations grow with the tokens of a micro-batch and, past small models, are the biggest part of a step's
peak. Autograd keeps every tensor a block's backward needs from that block's forward until its backward;
each mode here keeps fewer of them:

- `none`: autograd keeps everything.
- `full`: every block runs under non-reentrant `torch.utils.checkpoint`: forward keeps only the block's
  inputs, backward re-runs the block's forward (one extra forward of the blocks) to get the rest back.
- `fraction`: the same for the *first* k = round(fraction * L) blocks — the planner's continuous knob
  between none and full. Why the first ones: backward visits blocks in reverse, so when an early block is
  recomputed, every later block has already released its activations, and the recomputed block never
  stacks on top of them. Checkpointing the last blocks (or evenly spaced ones) costs the same recompute but
  re-materialises a block while all earlier, uncheckpointed blocks still hold their activations.
- `selective`: op-level checkpointing (torch's selective activation checkpointing): inside each block the
  outputs of matmul-like ops (mm, addmm, bmm, attention kernels: `activation_profile.MATMUL_OPS`) are kept
  and everything else — pointwise ops, norms, softmax, activations — is recomputed. The expensive FLOPs
  are never redone; the cheap, numerous elementwise tensors are not kept. Every matmul output is kept,
  saved by autograd or not (an output projection feeding a residual add is not), as torch's SAC does.
- `offload`: nothing is recomputed; each block's saved tensors go to host memory (pinned, copied on a side
  stream on CUDA) and come back when backward needs them. Weights are never copied.

How blocks are wrapped: each block *instance* gets a `forward` attribute that runs its class's forward under
the mode. The module tree, parameter names and state_dict keys stay exactly the same, so checkpoints load
across strategies, and hooks on the block itself (FSDP2's, the memory tracker's) run once, outside the
checkpointed region — transformers' own `GradientCheckpointingLayer` wraps `forward`, not `__call__`,
for the same reason.

Every recompute replays the forward bit for bit: non-reentrant checkpoint restores the RNG state of the
forward (dropout masks match), and the selective mode replays kept matmul outputs instead of recomputing
them. In fp32 the losses and gradients equal those of `none` exactly (the tests check `torch.equal`).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memtrain.activation_profile import is_matmul
from memtrain.errors import Unsupported
from memtrain.footprint import ActivationProfile, Footprint

NAMES = ("none", "full", "fraction", "selective", "offload")

# transformers layers take their KV cache under one of these names. A recomputed layer would append its keys
# and values a second time, so a checkpointed call drops the cache, as transformers' own checkpointing does.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

_WRAPPED = "_memtrain_checkpointing"  # marks a block whose forward this module replaced


@dataclass(frozen=True)
class Checkpointing:
    name: str
    fraction: float = 1.0

    def check(self, device: torch.device) -> None:
        """Raise `Unsupported` for options that cannot run on `device`.

        `offload` copies to pinned host memory on a CUDA side stream. On a CPU the host *is* the device:
        the same code path runs, moves nothing and saves nothing, which is allowed so that every path runs
        in CPU tests. Other accelerators have no offload path here.
        """
        self._check_options()
        if self.name == "offload" and device.type not in ("cuda", "cpu"):
            raise Unsupported(
                f"strategies.checkpointing: offload is implemented for CUDA devices, not {device.type}; "
                "use full or selective"
            )

    def _check_options(self) -> None:
        if self.name not in NAMES:
            raise Unsupported(
                f"strategies.checkpointing: unknown mode {self.name!r}; use one of {', '.join(NAMES)}"
            )
        if self.name == "fraction" and not 0.0 < self.fraction <= 1.0:
            raise Unsupported(
                f"strategies.checkpointing_fraction: must be in (0, 1], got {self.fraction}; "
                "use e.g. 0.5, or strategies.checkpointing=none / full"
            )
        if self.name != "fraction" and self.fraction != 1.0:
            raise Unsupported(
                f"strategies.checkpointing_fraction: {self.fraction} only applies to "
                "strategies.checkpointing=fraction"
            )

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        """Which blocks are recomputed in backward (`none` and `offload` recompute nothing)."""
        if self.name in ("full", "selective"):
            count = num_blocks
        elif self.name == "fraction":
            count = math.floor(self.fraction * num_blocks + 0.5)  # round half up, unlike round()
        else:
            count = 0
        return tuple(i < count for i in range(num_blocks))

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Wrap `blocks` (submodules of `model`, in forward order) in place; names and keys are unchanged."""
        self._check_options()
        owned = {id(m) for m in model.modules()}
        for block in blocks:
            if id(block) not in owned:
                raise ValueError(
                    f"strategies.checkpointing: {type(block).__name__} is not a submodule of the model"
                )
            if getattr(block, _WRAPPED, None) is not None:
                raise ValueError(
                    f"strategies.checkpointing: a {type(block).__name__} is already wrapped "
                    f"({getattr(block, _WRAPPED)}); apply checkpointing once"
                )
            if getattr(block, "gradient_checkpointing", False):
                raise ValueError(
                    "strategies.checkpointing: transformers' gradient checkpointing is enabled on the model; "
                    "call model.gradient_checkpointing_disable() and let memtrain checkpoint it"
                )
        if self.name == "offload":
            streams: dict[torch.device, torch.cuda.Stream] = {}
            for block in blocks:
                _replace_forward(block, functools.partial(_offloaded, block, streams), self.name)
            return
        context_fn = _selective_contexts if self.name == "selective" else None
        for block, recompute in zip(blocks, self.checkpointed(len(blocks)), strict=True):
            if recompute:
                _replace_forward(block, functools.partial(_checkpointed, block, context_fn), self.name)

    def estimate(self, profile: ActivationProfile, footprint: Footprint) -> Footprint:
        """`footprint` with `activations` set to this mode's peak activation bytes on the device.

        `profile` was measured without checkpointing. Per block i: P_i the bytes autograd saves, I_i its
        input bytes, M_i its matmul outputs, F_i and R_i what its forward holds at its peak and up to its
        last save (the profile's `block_peaks` and `recompute_peaks`; P_i - I_i for a profile
        without them); O what the head side holds.

        Through the forward each block keeps K_i: P_i without checkpointing, I_i when checkpointed,
        I_i + M_i when selective. Offloaded blocks keep nothing (each block's end waits for its copies),
        except that the first block's inputs (embeddings, rotary tables, masks) stay: the model's forward
        holds them. The peak is the largest of

        - the end of the forward: sum(K) + O;
        - a block that is not recomputed, running its forward: sum(K_j, j < i) + max(K_i, I_i + F_i);
        - a checkpointed block recomputed in backward, when the blocks after it and the head side have
          released theirs: sum(K_j, j < i) + max(K_i, I_i + R_i).

        O is taken to be all head side (embeddings save token ids, which are batch data), so it is gone
        before any block's backward. Checkpointing the first blocks (see `checkpointed`) keeps the last
        term low. On a CPU-only run host and device are one memory and `offload` saves nothing: the planner
        must read the `none` figure there.
        """
        count = len(profile.per_block)
        inputs = profile.block_inputs
        if profile.block_peaks:
            forward_peaks, recompute_peaks = profile.block_peaks, profile.recompute_peaks
        else:
            forward_peaks = recompute_peaks = tuple(
                p - i for p, i in zip(profile.per_block, inputs, strict=True)
            )
        recomputed = self.checkpointed(count)
        if self.name == "offload":
            kept = [inputs[0] if i == 0 else 0 for i in range(count)]
        else:
            matmul = profile.matmul_outputs if self.name == "selective" else (0,) * count
            kept = [
                inputs[i] + matmul[i] if again else profile.per_block[i] for i, again in enumerate(recomputed)
            ]
        running = max(
            (
                sum(kept[:i]) + max(kept[i], inputs[i] + (recompute_peaks if again else forward_peaks)[i])
                for i, again in enumerate(recomputed)
            ),
            default=0,
        )
        return footprint.with_(activations=max(sum(kept) + profile.outside_blocks, running))


def _replace_forward(block: nn.Module, forward: Callable[..., Any], mode: str) -> None:
    # An instance attribute shadows the class's forward; nn.Module.__call__ looks `self.forward` up per call.
    block.forward = forward  # type: ignore[method-assign]
    setattr(block, _WRAPPED, mode)


def _class_forward(block: nn.Module) -> Callable[..., Any]:
    return type(block).forward.__get__(block)  # type: ignore[no-any-return]


def _checkpointed(
    block: nn.Module,
    context_fn: Callable[[], tuple[Any, Any]] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    forward = _class_forward(block)
    if not torch.is_grad_enabled():  # no backward, nothing to save: run as is (eval, generation)
        return forward(*args, **kwargs)
    if not getattr(block, "_can_checkpoint_with_cache", False):
        for name in _CACHE_KWARGS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _keep_matmul_outputs(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_matmul(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_matmul_outputs)


def _offloaded(
    block: nn.Module, streams: dict[torch.device, torch.cuda.Stream], *args: Any, **kwargs: Any
) -> Any:
    forward = _class_forward(block)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # Parameters (and their views, e.g. the transposed weight mm saves) live on the device anyway: copying
    # them would cost bandwidth and host memory for nothing. Gathered per call: FSDP2 swaps in unsharded ones.
    resident = {id(t.untyped_storage()) for t in (*block.parameters(), *block.buffers())}
    with _HostOffload(resident, streams):
        return forward(*args, **kwargs)


class _Packed:
    """One saved tensor's host copy; `restored` lets the views autograd saved of it share one device copy."""

    __slots__ = ("host", "device", "restored")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host = host
        self.device = device
        self.restored: weakref.ref[torch.Tensor] | None = None


class _HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of one block's forward → host memory; back to the device when backward unpacks them.

    On CUDA the device→host copies run on a side stream, overlapping the rest of the block's forward; the
    originals stay referenced (`_pending`) until the block ends, then one wait on the side stream makes
    them free. That bounds what is on the device to one block's saved tensors, with no `record_stream`
    subtleties: memory is released only after its copy has finished. Unpacking copies host→device on the
    current stream (pinned, non-blocking, ordered before the backward kernels that read it); nothing is
    prefetched, so the copies are on backward's critical path.
    """

    def __init__(self, resident: set[int], streams: dict[torch.device, torch.cuda.Stream]) -> None:
        self._resident = resident
        self._streams = streams
        self._pending: list[torch.Tensor] = []
        self._packed: dict[tuple[Any, ...], _Packed] = {}
        super().__init__(self._pack, self._unpack)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for device in {t.device for t in self._pending if t.device.type == "cuda"}:
            self._streams[device].synchronize()
        self._pending.clear()
        self._packed.clear()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Packed:
        storage = tensor.untyped_storage()
        if id(storage) in self._resident or tensor.layout != torch.strided:
            return tensor
        # The q, k and v projections save three views of one normalised input: copy it once. The key is safe
        # while `_pending` keeps the original (and so its address) alive.
        key = (
            storage.data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        packed = self._packed.get(key)
        if packed is None:
            packed = self._packed[key] = _Packed(self._to_host(tensor), tensor.device)
            self._pending.append(tensor)
        return packed

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor  # host memory already: keeping the tensor is the move
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        # Same strides as the original (for a dense tensor), so backward reads it through the same kernels.
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producer must finish
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        return host

    @staticmethod
    def _unpack(packed: torch.Tensor | _Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        restored = packed.restored() if packed.restored is not None else None
        if restored is None:
            restored = packed.host.to(packed.device, non_blocking=True)
            packed.restored = weakref.ref(restored)
        return restored
