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
- `selective-op`: torchtitan's selective activation checkpointing in its default `op` mode
  (`selective_ac_option: op`), the policy behind its published memory figures. Inside each block torch's
  SAC keeps the outputs of the ops on torchtitan's save list (`aten.mm`, the SDPA kernels, a full
  `aten.max` for float8 scales, the reduce-scatter and all-to-all of tensor and expert parallelism, flex
  attention) except every second `aten.mm` of the block, counted per block call (forward and recompute
  count apart, so the recompute replays the forward's choices), and recomputes everything else. It keeps
  less than `selective` (about half the projections: for a Llama block q, v, gate and down are kept, k, o
  and up recomputed) and redoes those matmuls in backward. Only `aten.mm` counts: a linear with a bias
  runs `addmm`, which the list does not name, so it is recomputed (as in torchtitan). On the CPU the CPU
  flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) plays the CUDA kernels' part.
- `offload`: nothing is recomputed; each block's saved tensors go to host memory (pinned, copied on a side
  stream on CUDA) and come back when backward needs them. Weights are never copied.

How blocks are wrapped: each block *instance* gets a `forward` attribute that runs its class's forward under
the mode (`unwrap_blocks` removes it again, so a run can switch modes between steps). The module tree, parameter names and state_dict keys stay exactly the same, so checkpoints load
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
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memtrain.errors import Unsupported
from memtrain.memory.activation_profile import is_matmul
from memtrain.memory.footprint import ActivationProfile, Footprint
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy, option

# transformers layers take their KV cache under one of these names. A recomputed layer would append its keys
# and values a second time, so a checkpointed call drops the cache, as transformers' own checkpointing does.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

_WRAPPED = "_memtrain_checkpointing"  # marks a block whose forward this module replaced


@dataclass(frozen=True)
class Checkpointing(Strategy):
    """`none`: autograd keeps everything. Subclasses choose which blocks to recompute and how.

    Facts the planner reads: `checkpointed(num_blocks)` (which blocks recompute), `recompute` (what a
    recompute costs: "forward" of the block, "elementwise" ops only, or "none"), `recomputed_matmuls`
    (the share of the recomputed blocks' weight matmuls an "elementwise" recompute runs again too),
    `offloads_activations`, and `block_modes` / `traced_modes` (the modes whose traces stand for each
    block's memory).
    """

    kind: ClassVar[str] = "checkpointing"
    name: ClassVar[str] = "none"
    recompute: ClassVar[str] = "none"
    recomputed_matmuls: ClassVar[float] = 0.0
    offloads_activations: ClassVar[bool] = False

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        """Which blocks are recomputed in backward."""
        return (False,) * num_blocks

    def block_modes(self, num_blocks: int, device_type: str) -> tuple[Checkpointing, ...]:
        """The traced mode each block runs in: a block-wise mode is `full` where it recomputes, `none`
        elsewhere (modes that change how a block runs override this)."""
        return tuple(
            FullCheckpointing() if again else NoCheckpointing() for again in self.checkpointed(num_blocks)
        )

    def traced_modes(self, device_type: str) -> tuple[Checkpointing, ...]:
        """The modes a prediction of this one needs traces of."""
        if type(self).block_modes is Checkpointing.block_modes:
            return (NoCheckpointing(), FullCheckpointing())
        return (self,)

    def search_variants(self, fractions: tuple[float, ...], pinned: bool) -> tuple[Checkpointing, ...]:
        """The settings of this mode the planner tries (a mode with a knob offers several unless pinned)."""
        return (self,)

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Wrap `blocks` (submodules of `model`, in forward order) in place; names and keys are unchanged."""
        _check_wrappable(model, blocks)
        for block, recompute in zip(blocks, self.checkpointed(len(blocks)), strict=True):
            if recompute:
                _replace_forward(block, functools.partial(_checkpointed, block, self.context_fn()), self.name)

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        """torch checkpoint's `context_fn` for recomputed blocks (selective checkpointing's policy)."""
        return None

    def kept_bytes(self, profile: ActivationProfile, block: int, recomputed: bool) -> int:
        """What block `block` keeps through the forward (see `estimate`)."""
        return profile.block_inputs[block] if recomputed else profile.per_block[block]

    def estimate(self, profile: ActivationProfile, footprint: Footprint) -> Footprint:
        """`footprint` with `activations` set to this mode's peak activation bytes on the device.

        `profile` was measured without checkpointing. Per block i: P_i the bytes autograd saves, I_i its
        input bytes, M_i its matmul outputs, F_i and R_i what its forward holds at its peak and up to its
        last save (the profile's `block_peaks` and `recompute_peaks`; P_i - I_i for a profile
        without them); O what the head side holds.

        Through the forward each block keeps K_i (`kept_bytes`): P_i without checkpointing, I_i when
        checkpointed, I_i + M_i when selective. Offloaded blocks keep nothing (each block's end waits for
        its copies), except that the first block's inputs (embeddings, rotary tables, masks) stay: the
        model's forward holds them. The peak is the largest of

        - the end of the forward: sum(K) + O;
        - a block that is not recomputed, running its forward: sum(K_j, j < i) + max(K_i, I_i + F_i);
        - a checkpointed block recomputed in backward, when the blocks after it and the head side have
          released theirs: sum(K_j, j < i) + max(K_i, I_i + R_i).

        O is taken to be all head side (embeddings save token ids, which are batch data), so it is gone
        before any block's backward. Checkpointing the first blocks (see `FractionCheckpointing`) keeps the
        last term low. On a CPU-only run host and device are one memory and `offload` saves nothing: the
        planner must read the `none` figure there.
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
        kept = [self.kept_bytes(profile, i, again) for i, again in enumerate(recomputed)]
        running = max(
            (
                sum(kept[:i]) + max(kept[i], inputs[i] + (recompute_peaks if again else forward_peaks)[i])
                for i, again in enumerate(recomputed)
            ),
            default=0,
        )
        return footprint.with_(activations=max(sum(kept) + profile.outside_blocks, running))


CHECKPOINTING: Registry[Checkpointing] = Registry(
    "checkpointing",
    Checkpointing,
    RecipeKey(
        "strategies",
        "checkpointing",
        "none",
        "Activation checkpointing: which blocks keep less in forward and recompute in backward.",
        changes_trajectory=False,
    ),
)


@CHECKPOINTING.register
@dataclass(frozen=True)
class NoCheckpointing(Checkpointing):
    name: ClassVar[str] = "none"

    def block_modes(self, num_blocks: int, device_type: str) -> tuple[Checkpointing, ...]:
        return (self,) * num_blocks


@CHECKPOINTING.register
@dataclass(frozen=True)
class FullCheckpointing(Checkpointing):
    """Every block recomputes its forward in backward; forward keeps only the blocks' inputs."""

    name: ClassVar[str] = "full"
    recompute: ClassVar[str] = "forward"

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        return (True,) * num_blocks

    def block_modes(self, num_blocks: int, device_type: str) -> tuple[Checkpointing, ...]:
        return (self,) * num_blocks


@CHECKPOINTING.register
@dataclass(frozen=True)
class FractionCheckpointing(Checkpointing):
    """The first round(fraction * L) blocks recompute (see the module docstring for why the first)."""

    name: ClassVar[str] = "fraction"
    recompute: ClassVar[str] = "forward"
    fraction: float = option(
        0.5,
        doc="Share of blocks recomputed when checkpointing is 'fraction'.",
        changes_trajectory=False,
        gt=0.0,
        le=1.0,
    )

    def check(self, facts: DeviceFacts) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise Unsupported(
                f"strategies.checkpointing_fraction: must be in (0, 1], got {self.fraction}; "
                "use e.g. 0.5, or strategies.checkpointing=none / full"
            )

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        count = math.floor(self.fraction * num_blocks + 0.5)  # round half up, unlike round()
        return tuple(i < count for i in range(num_blocks))

    def describe(self) -> str:
        return f"fraction({self.fraction:g})"

    def search_variants(self, fractions: tuple[float, ...], pinned: bool) -> tuple[Checkpointing, ...]:
        """`strategies.checkpointing_fraction` when pinned, else each of `planner.checkpointing_fractions`."""
        return (self,) if pinned else tuple(FractionCheckpointing(f) for f in fractions)

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        self.check(DeviceFacts("cpu"))
        super().apply(model, blocks)


@CHECKPOINTING.register
@dataclass(frozen=True)
class SelectiveCheckpointing(Checkpointing):
    """Op-level: every block keeps its matmul outputs and recomputes the rest."""

    name: ClassVar[str] = "selective"
    recompute: ClassVar[str] = "elementwise"

    def checkpointed(self, num_blocks: int) -> tuple[bool, ...]:
        return (True,) * num_blocks

    def block_modes(self, num_blocks: int, device_type: str) -> tuple[Checkpointing, ...]:
        return (self,) * num_blocks

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        return _selective_contexts

    def kept_bytes(self, profile: ActivationProfile, block: int, recomputed: bool) -> int:
        return profile.block_inputs[block] + profile.matmul_outputs[block]


@CHECKPOINTING.register
@dataclass(frozen=True)
class AlternateMatmulCheckpointing(SelectiveCheckpointing):
    """torchtitan's op-level selective checkpointing: every block keeps the outputs of the ops on its save
    list, but only every other `aten.mm`'s, and recomputes the rest (see the module docstring).

    The planner traces it as itself; its `estimate` from a `none` profile is `selective`'s, an upper bound
    (the profile does not tell every other matmul from the rest).

    Its recompute, for the step-time model: the elementwise ops, as `selective` recomputes them, plus every
    second `mm` of a block, taken as half of the block's weight matmuls (`recomputed_matmuls`: 2 FLOPs per
    block weight per token, times 0.5); the attention core is kept, so none of it. Half is exact for mms of
    alike sizes; a Llama block recomputes its smaller ones (k, o, up: 36.5% of Llama 3 8B's block weights,
    39% of the test llama's), so the model charges a little more than it runs, and a block of biased
    linears (`addmm`) recomputes more. That places it between `selective` and `full`."""

    name: ClassVar[str] = "selective-op"
    recomputed_matmuls: ClassVar[float] = 0.5

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        return _alternate_matmul_contexts


@CHECKPOINTING.register
@dataclass(frozen=True)
class OffloadCheckpointing(Checkpointing):
    """Nothing recomputes; saved tensors go to pinned host memory and come back for backward."""

    name: ClassVar[str] = "offload"
    offloads_activations: ClassVar[bool] = True

    def check(self, facts: DeviceFacts) -> None:
        """`offload` copies to pinned host memory on a CUDA side stream. On a CPU the host *is* the device:
        the same code path runs, moves nothing and saves nothing, which is allowed so that every path runs
        in CPU tests. Other accelerators have no offload path here."""
        if facts.device_type not in ("cuda", "cpu"):
            raise Unsupported(
                f"strategies.checkpointing: offload is implemented for CUDA devices, not {facts.device_type}; "
                "use full or selective"
            )

    def block_modes(self, num_blocks: int, device_type: str) -> tuple[Checkpointing, ...]:
        """On a CPU offload keeps saved tensors where they are: `none` there. On CUDA the planner derives
        its segments from the `none` and `full` traces."""
        return (NoCheckpointing(),) * num_blocks if device_type != "cuda" else (self,) * num_blocks

    def traced_modes(self, device_type: str) -> tuple[Checkpointing, ...]:
        return (NoCheckpointing(), FullCheckpointing()) if device_type == "cuda" else (NoCheckpointing(),)

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        _check_wrappable(model, blocks)
        streams: dict[torch.device, torch.cuda.Stream] = {}
        for block in blocks:
            _replace_forward(block, functools.partial(_offloaded, block, streams), self.name)

    def kept_bytes(self, profile: ActivationProfile, block: int, recomputed: bool) -> int:
        return profile.block_inputs[0] if block == 0 else 0


def unwrap_blocks(blocks: list[nn.Module]) -> None:
    """Undo `Checkpointing.apply` on `blocks`: each block gets its class's forward back (a re-plan during a
    run switches modes by unwrapping, then applying the new mode; names, keys and hooks never changed)."""
    for block in blocks:
        if getattr(block, _WRAPPED, None) is not None:
            del block.forward
            delattr(block, _WRAPPED)


def _check_wrappable(model: nn.Module, blocks: list[nn.Module]) -> None:
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
    forward = _running_stats_updated_once(block, forward)
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _running_stats_updated_once(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward`, whose second call (the recompute in backward) leaves the block's normalisation running
    statistics (BatchNorm's, InstanceNorm's with `track_running_stats`) as the first call left them: the
    recompute must normalise as the forward did (training mode, batch statistics) but not count the batch
    twice, or a checkpointed model's running statistics (and so its evaluation) would differ from
    `none`'s (num_batches_tracked doubled, the running mean moved twice). It runs with momentum 0 and no
    batch counter: attributes only, no tensor op, so selective recompute sees the forward's ops."""
    norms = [
        module
        for module in block.modules()
        if module.training and getattr(module, "track_running_stats", False) and hasattr(module, "momentum")
    ]
    if not norms:
        return forward
    calls = 0

    def once(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return forward(*args, **kwargs)
        saved = [(norm.momentum, getattr(norm, "num_batches_tracked", None)) for norm in norms]
        for norm in norms:
            norm.momentum = 0.0  # type: ignore[assignment]  # BatchNorm: float | None
            if hasattr(norm, "num_batches_tracked"):
                norm.num_batches_tracked = None  # type: ignore[assignment]  # a buffer may be None
        try:
            return forward(*args, **kwargs)
        finally:
            for norm, (momentum, counter) in zip(norms, saved, strict=True):
                norm.momentum = momentum
                if counter is not None:
                    norm.num_batches_tracked = counter

    return once


def _keep_matmul_outputs(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_matmul(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_matmul_outputs)


def _overloads(names: tuple[str, ...], namespace: Any) -> frozenset[Any]:
    """The `.default` overloads of the ops `names` that this torch has (older ones lack a few)."""
    packets = (getattr(namespace, name, None) for name in names)
    return frozenset(packet.default for packet in packets if packet is not None)


# torchtitan's save list (its models' `_op_sac_save_list`), the CPU flash kernel added as the CUDA kernels'
# stand-in on a CPU. `aten.max.default` is the full reduction (float8's amax), not max along a dimension.
_MM = torch.ops.aten.mm.default
_OP_SAVE_LIST: frozenset[Any] = (
    _overloads(
        (
            "mm",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable",
            "max",
        ),
        torch.ops.aten,
    )
    | _overloads(("reduce_scatter_tensor", "all_to_all_single"), torch.ops._c10d_functional)
    | frozenset(op for op in (getattr(torch.ops.higher_order, "flex_attention", None),) if op is not None)
)


def _alternate_matmul_contexts() -> tuple[Any, Any]:
    """One block call's SAC contexts: a fresh count of `aten.mm` calls, apart for the forward and its
    recompute, so that the recompute makes the forward's choices op by op (torch replays a saved op's
    output in the order the forward saved them)."""
    mm_calls = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        if op == _MM:
            mm_calls[ctx.is_recompute] += 1
            if mm_calls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _OP_SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


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
