"""Pins the private torch APIs memtrain relies on; a failure names the torch version and the API.

If one of these fails after a torch upgrade, fix src/memtrain/memory/_torch_private.py (and only that file).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NoReturn

import pytest
import torch

from memtrain.memory import _torch_private

VERSION = f"torch {torch.__version__}"


def _fail(api: str, what: str) -> NoReturn:
    pytest.fail(f"{VERSION} changed private API {api}: {what}. Update src/memtrain/memory/_torch_private.py.")


def test_torch_dispatch_mode_sees_op_outputs() -> None:
    seen: list[str] = []

    class Probe(_torch_private.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            seen.append(str(func))
            return out

    try:
        with Probe():
            torch.ones(3).mul(2)
    except Exception as e:  # any failure here means the API moved
        _fail("torch.utils._python_dispatch.TorchDispatchMode", repr(e))
    if "aten.mul.Tensor" not in seen:
        _fail(
            "torch.utils._python_dispatch.TorchDispatchMode", f"did not report aten.mul.Tensor (saw {seen})"
        )


def test_storage_python_object_lives_as_long_as_the_storage() -> None:
    # Not a private API but an implementation property the ledger's free detection depends on.
    import gc
    import weakref

    t = torch.ones(4)
    ref = weakref.ref(t.untyped_storage())
    gc.collect()
    view = t[1:]
    del t
    gc.collect()
    if ref() is None or ref() is not view.untyped_storage():
        _fail("UntypedStorage PyObject preservation", "the storage's Python object died before the storage")
    del view
    if ref() is not None:
        _fail("UntypedStorage PyObject preservation", "the storage's Python object outlived the storage")


def test_cuda_memory_history_functions_exist() -> None:
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    dump = getattr(torch.cuda.memory, "_dump_snapshot", None)
    if record is None or dump is None or getattr(torch.cuda.memory, "_snapshot", None) is None:
        _fail("torch.cuda.memory._record_memory_history/_dump_snapshot/_snapshot", "missing")
    params = inspect.signature(record).parameters
    if not {"enabled", "max_entries"} <= set(params):
        _fail("torch.cuda.memory._record_memory_history", f"parameters are now {list(params)}")
    if "filename" not in inspect.signature(dump).parameters:
        _fail("torch.cuda.memory._dump_snapshot", "no `filename` parameter")


def test_allocator_settings_getter() -> None:
    try:
        settings = _torch_private.allocator_settings()
    except AttributeError as e:
        _fail("torch._C._accelerator_getAllocatorSettings", repr(e))
    assert isinstance(settings, str)


def test_fake_tensor_mode_gives_meta_storages() -> None:
    try:
        with _torch_private.fake_tensors():
            device = torch.ones(3).untyped_storage().device
    except Exception as e:  # any failure here means the API moved
        _fail("torch._subclasses.fake_tensor.FakeTensorMode", repr(e))
    if device.type != "meta":
        _fail("torch._subclasses.fake_tensor.FakeTensorMode", f"storages are on {device}, not meta")


def test_tree_leaves_flattens_nested_containers() -> None:
    a, b = torch.zeros(1), torch.ones(1)
    try:
        leaves = _torch_private.tree_leaves({"x": [a, (b, 3)]})
    except Exception as e:  # noqa: BLE001 - any failure means the API moved
        _fail("torch.utils._pytree.tree_leaves", repr(e))
    if [id(x) for x in leaves if isinstance(x, torch.Tensor)] != [id(a), id(b)]:
        _fail("torch.utils._pytree.tree_leaves", f"returned {leaves!r}")


# The CUDA kernels' aten ops the planner's CUDA trace calls: the arguments the wrappers pass, in order.
CUDA_KERNEL_OPS = {
    "_scaled_dot_product_flash_attention": (
        ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"]
    ),
    "_scaled_dot_product_efficient_attention": (
        ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"]
    ),
    "_scaled_dot_product_attention_math": (
        [
            "query",
            "key",
            "value",
            "attn_mask",
            "dropout_p",
            "is_causal",
            "dropout_mask",
            "scale",
            "enable_gqa",
        ]
    ),
    "native_dropout": ["input", "p", "train"],
}


@pytest.mark.parametrize(("op", "arguments"), CUDA_KERNEL_OPS.items())
def test_cuda_kernel_ops_keep_their_signatures(op: str, arguments: list[str]) -> None:
    try:
        schema = getattr(torch.ops.aten, op).default._schema
    except (AttributeError, RuntimeError) as e:
        _fail(f"torch.ops.aten.{op}", repr(e))
    names = [a.name for a in schema.arguments]
    if names != arguments:
        _fail(f"torch.ops.aten.{op}", f"arguments are now {names}, not {arguments}")


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _backward_of(run: Attention) -> tuple[str, torch.Tensor]:
    """The backward node's name and the output of `run(q, k, v)` on fake (B, H, S, D) bf16 tensors."""
    with _torch_private.fake_tensors():
        q, k, v = (torch.empty(2, 4, 32, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = run(q, k, v)
        return type(out.grad_fn).__name__, out


@pytest.mark.parametrize(
    ("run", "node"),
    [
        (lambda q, k, v: _torch_private.flash_attention(q, k, v, 0.1, True, None), "FlashAttention"),
        (
            lambda q, k, v: _torch_private.efficient_attention(q, k, v, None, True, 0.1, True, None),
            "EfficientAttention",
        ),
        (lambda q, k, v: _torch_private.math_attention(q, k, v, None, 0.1, True, None, False), "Math"),
    ],
)
def test_attention_kernels_run_under_fake_tensors_with_their_backward(run: Attention, node: str) -> None:
    name, out = _backward_of(run)
    if out.shape != (2, 4, 32, 16) or out.dtype != torch.bfloat16:
        _fail(f"SDPA {node} op", f"output {tuple(out.shape)} {out.dtype}")
    if node != "Math" and node not in name:  # the math op is a composite: its last op's node
        _fail(f"SDPA {node} op", f"backward node is {name}")


def test_native_dropout_keeps_a_bool_mask() -> None:
    with _torch_private.fake_tensors():
        x = torch.empty(4, 8, requires_grad=True)
        out = _torch_private.native_dropout(x, 0.1)
        mask = torch.ops.aten.native_dropout(x, 0.1, True)[1]
    if type(out.grad_fn).__name__ != "NativeDropoutBackward0" or mask.dtype != torch.bool:
        _fail("torch.ops.aten.native_dropout", f"backward {out.grad_fn}, mask {mask.dtype}")


def test_grouped_mm_op_and_its_backward() -> None:
    names = [a.name for a in torch.ops.aten._grouped_mm.default._schema.arguments]
    if names != ["self", "mat2", "offs", "bias", "out_dtype"]:
        _fail("torch.ops.aten._grouped_mm", f"arguments are now {names}")
    with _torch_private.fake_tensors():
        x = torch.empty(6, 8, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)  # rows of 16-byte multiples
        out = _torch_private.grouped_mm(x, w, torch.tensor([2, 6], dtype=torch.int32))
        fake = _torch_private.is_fake(out)
    if out.shape != (6, 16) or type(out.grad_fn).__name__ != "GroupedMmBackward0":
        _fail("torch.ops.aten._grouped_mm", f"output {tuple(out.shape)}, backward {out.grad_fn}")
    if not fake or _torch_private.is_fake(torch.ones(1)):
        _fail("torch._subclasses.fake_tensor.FakeTensor", "no longer tells fake tensors from real ones")


def test_grouped_mm_replaced_reaches_functional_grouped_mm() -> None:
    original = torch._grouped_mm
    seen: list[torch.Size] = []

    def replacement(mat_a: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(mat_a.shape)
        return mat_a

    with _torch_private.grouped_mm_replaced(replacement):
        torch.nn.functional.grouped_mm(torch.ones(2, 3), torch.ones(1, 3, 2), offs=torch.tensor([2]))
    if seen != [torch.Size([2, 3])]:
        _fail("torch._grouped_mm", "F.grouped_mm no longer calls it")
    if torch._grouped_mm is not original:
        _fail("torch._grouped_mm", "not restored")


def test_host_values_keep_real_values_and_read_fake_ones_as_placeholders() -> None:
    """The rank trace's values (memtrain.training.rank_trace): an op on real tensors stays real under the fake
    mode (a token count keeps its value), a fake tensor read as a number is 1, 1.0 or False."""
    from memtrain.memory import HostValues, fake_tensors_with_real_inputs
    from memtrain.memory._torch_private import is_fake

    with fake_tensors_with_real_inputs(), HostValues():
        fake = torch.empty(3)
        counts = torch.tensor([4, 5])  # `lift_fresh` of a real tensor
        assert is_fake(fake) and not is_fake(counts)
        assert int(counts.sum()) == 9
        assert int(fake.sum().long()) == 1 and float(fake.sum()) == 1.0 and not bool((fake > 0).any())


def test_the_fake_process_group_joins_as_any_rank() -> None:
    import torch.distributed as dist

    from memtrain.memory import join_fake_process_group

    assert not dist.is_initialized()
    try:
        join_fake_process_group(3, 8)
        assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
        out = torch.zeros(2)
        dist.all_reduce(out)  # returns at once, nothing sent
    finally:
        dist.destroy_process_group()


def test_fused_optimizer_check() -> None:
    """torch's fused-optimizer check (made at the first step) as `OptimizerStates.build` asks it first."""
    try:
        floating = _torch_private.fused_optimizer_steps(torch.zeros(2))
        integral = _torch_private.fused_optimizer_steps(torch.zeros(2, dtype=torch.int64))
        meta = _torch_private.fused_optimizer_steps(torch.zeros(2, device="meta"))
    except (AttributeError, TypeError) as e:
        _fail("torch.optim.optimizer._device_dtype_check_for_fused", repr(e))
    if (floating, integral, meta) != (True, False, False):
        _fail(
            "torch.optim.optimizer._device_dtype_check_for_fused",
            f"cpu fp32/int64/meta: {floating, integral, meta}",
        )
