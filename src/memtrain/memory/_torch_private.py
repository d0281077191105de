"""Every private torch API memtrain touches, behind one module.

Private APIs change without deprecation. Keeping them here means one file to fix when the pinned torch moves,
and tests/memory/test_torch_private.py names the torch version and the API that broke.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.optim.optimizer import _device_dtype_check_for_fused
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "TorchDispatchMode",
    "tree_leaves",
    "allocator_settings",
    "allocation_sizes",
    "dump_memory_snapshot",
    "efficient_attention",
    "HostValues",
    "fake_tensors",
    "fake_tensors_with_real_inputs",
    "flash_attention",
    "fused_optimizer_steps",
    "grouped_mm",
    "grouped_mm_replaced",
    "is_fake",
    "join_fake_process_group",
    "math_attention",
    "memory_snapshot",
    "native_dropout",
    "record_memory_history",
]


class _FakeTensors(FakeTensorMode):
    """A fake tensor keeps its mode in its `__dict__`, so a deep copy of one (a module copying its layers
    while it is built: `nn.TransformerEncoder`, `nn.TransformerDecoder`) held a copy of the mode, and the
    first op mixing the copies' tensors with others failed ("Mixing fake modes NYI"). The mode copies as
    itself."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _FakeTensors:
        return self


# `Tensor.__deepcopy__` reads a fake tensor's data pointer (0) to decide to clone it: harmless, and warned.
warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor is deprecated")


def fake_tensors() -> FakeTensorMode:
    """A mode whose tensors have shapes, dtypes and (meta) storages but no memory.

    A MemoryTracker used inside it counts a training step of any size on the CPU, byte for byte as the
    real step would (the storages it sees are the same, only on the meta device).
    """
    return _FakeTensors()


def fake_tensors_with_real_inputs() -> FakeTensorMode:
    """`fake_tensors()` that also takes real tensors as op inputs (turned into fake ones): a fake model fed
    real batches (the planner's rank trace, memtrain.training.rank_trace)."""
    return _FakeTensors(allow_non_fake_inputs=True)


class HostValues(TorchDispatchMode):
    """Inside an active fake-tensor mode: an op whose tensor inputs are all real runs for real, outside the
    fake mode, so the values a step reads from its batch keep them (token counts, a flag or a shape agreed
    over ranks: `torch.tensor(...)` is an op on a real tensor); a fake tensor read as a Python number, which
    has no value, reads as a placeholder: 1 for an integer (a count), 1.0 for a float (a norm, a loss), False
    for a flag (nothing failed, nothing is non-finite). Ops without tensor inputs (`torch.empty`) stay fake.
    Enter it after the fake mode (a mode entered later sees each op first)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            dtype = args[0].dtype
            return False if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def join_fake_process_group(rank: int, world_size: int) -> None:
    """Make this process rank `rank` of `world_size` in torch's fake process group (every collective
    returns at once; nothing is sent): one rank of a mesh run in one process. Leaves a group this process
    joined before first (the group is process-global)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def in_backward() -> bool:
    """Whether this thread runs an autograd backward now (a hook or op the engine calls)."""
    return bool(torch._C._current_graph_task_id() != -1)


def fused_optimizer_steps(tensor: torch.Tensor) -> bool:
    """Whether torch's fused optimizers (`fused=True`) can step `tensor`: torch's own check (a floating tensor
    on a device with fused kernels), which torch makes only at the first step."""
    try:
        _device_dtype_check_for_fused(tensor)
    except RuntimeError:
        return False
    return True


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a `fake_tensors()` tensor (shape, dtype and a meta storage, no data)."""
    return isinstance(tensor, FakeTensor)


def grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`aten._grouped_mm`, the grouped (per-expert) matmul of mixture-of-experts layers (`torch._grouped_mm`,
    `F.grouped_mm`); its backward node, `GroupedMmBackward0`, keeps `mat_a`, `mat_b` and `offs`. Its meta
    kernel (what runs under `fake_tensors()`) accepts bf16 inputs only."""
    return torch.ops.aten._grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


@contextlib.contextmanager
def grouped_mm_replaced(replacement: Callable[..., torch.Tensor]) -> Iterator[None]:
    """While open, `torch._grouped_mm` (which `F.grouped_mm` calls too) is `replacement`; restored on exit."""
    original = torch._grouped_mm
    torch._grouped_mm = replacement
    try:
        yield
    finally:
        torch._grouped_mm = original


def record_memory_history(enabled: bool, max_entries: int) -> None:
    """Start (or stop) the CUDA caching allocator's alloc/free history with stack traces."""
    torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)


def memory_snapshot() -> dict[str, Any]:
    """The allocator snapshot in memory: `segments` and, while the history records, `device_traces` (one
    list of entries per device: `action`, `addr`, `size`, `stream`, ...)."""
    return dict(torch.cuda.memory._snapshot())


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator snapshot (with the recorded history) as a pickle for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(path)


def allocator_settings() -> str:
    """The caching allocator's settings string, e.g. "expandable_segments:True" (env var or set at runtime)."""
    return str(torch._C._accelerator_getAllocatorSettings())


# The CUDA kernels' aten ops, for the planner's trace of a CUDA target (planner/attention_kernels.py,
# planner/cuda_dropout.py). Under FakeTensorMode each runs its meta implementation on fake CPU tensors and
# autograd records the op's own backward node (derivatives.yaml), so the trace keeps what the kernel keeps.


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """The output of `aten._scaled_dot_product_flash_attention` (its backward keeps q, k, v, the output, an
    fp32 log-sum-exp and the philox RNG state)."""
    outputs = torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    return outputs[0]


def efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | None,
    compute_log_sumexp: bool,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """The output of `aten._scaled_dot_product_efficient_attention` (its backward keeps q, k, v, the bias,
    the output, the log-sum-exp and the philox seed and offset)."""
    outputs = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, scale=scale
    )
    return outputs[0]


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """The output of `aten._scaled_dot_product_attention_math`, the composite every device falls back to
    (its autograd keeps the probabilities)."""
    outputs = torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return outputs[0]


def native_dropout(input: torch.Tensor, p: float) -> torch.Tensor:
    """The output of `aten.native_dropout` in training, the fused dropout `F.dropout` runs on CUDA (its
    backward, `native_dropout_backward`, keeps a bool mask: one byte per element)."""
    return torch.ops.aten.native_dropout(input, p, True)[0]


def allocation_sizes(profile: torch.profiler.profile) -> list[int]:
    """The signed sizes of every allocation (+) and free (-) a memory-profiling `profile` recorded, in the
    order they happened (the event tree is private: `torch._C._profiler`)."""
    from torch._C._profiler import _ExtraFields_Allocation

    found: list[tuple[int, int]] = []
    results = profile.profiler.kineto_results if profile.profiler else None
    stack = list(results.experimental_event_tree()) if results is not None else []
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            found.append((node.start_time_ns, int(fields.alloc_size)))
        stack.extend(node.children)
    return [size for _, size in sorted(found)]
