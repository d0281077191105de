"""Pins the private torch APIs memtrain.memory relies on; a failure names the torch version and the API.

If one of these fails after a torch upgrade, fix src/memtrain/memory/_torch_private.py (and only that file).
"""

from __future__ import annotations

import inspect
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
    if record is None or dump is None:
        _fail("torch.cuda.memory._record_memory_history/_dump_snapshot", "missing")
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
