"""Readers for the checkpoint files that torch's DCP and DeepSpeed would unpickle whole: allow-lists only.

Why: a run directory is data. Anyone who can write into a shared one could otherwise plant a pickle
that runs code as whoever resumes or exports the run. `memtrain.checkpoint` already reads memtrain's
own tensor files with `torch.load(weights_only=True)`, but two libraries read theirs with full pickle:

- torch.distributed.checkpoint: `FileSystemReader.read_metadata` runs `pickle.load` on `dcp/.metadata`,
  and `DefaultLoadPlanner.load_bytes` (which `_EmptyStateDictLoadPlanner` inherits) runs
  `torch.load(weights_only=False)` on every non-tensor item (an optimizer's learning rate, its betas).
  `SafeFileSystemReader` unpickles the metadata with an unpickler that resolves only the classes DCP
  metadata is made of (`DCP_METADATA_GLOBALS`, found by reading torch's `metadata.py` / `filesystem.py`
  and the `.metadata` of real FSDP2 checkpoints); `SafeLoadPlanner` and `SafeEmptyStateDictLoadPlanner`
  load byte items with `weights_only=True`.
- DeepSpeed reads its files with `torch.load(weights_only=False)`: through the engine's checkpoint
  engine on resume, and directly in `deepspeed.utils.zero_to_fp32` on export. Both go through
  `load_deepspeed_file`: `weights_only=True` plus the few DeepSpeed classes its ZeRO files really hold
  (`deepspeed_globals`, found with `torch.serialization.get_unsafe_globals_in_checkpoint` on checkpoints of
  2-rank CPU runs of zero1/zero2/zero3, fp32 and bf16-mixed, with and without optimizer offload). The
  engine gets a checkpoint engine of our own for the duration of `load_checkpoint` (`deepspeed_reads_safely`).
  `zero_to_fp32` has no such hook: it calls its module's `torch.load`, so for the duration of one export
  `zero_to_fp32_reads_safely` replaces that module's `torch` name (and nothing else, in no other module)
  by a view of torch whose `load` is `load_deepspeed_file`.

A file that names anything else is refused with a `CheckpointError` naming it: it was not written by
memtrain's backends, and nothing of it runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import stat
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from memtrain import jsonfile
from memtrain.checkpoint import CheckpointError, load_weights_only

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
MAX_DCP_METADATA_BYTES = 256 * 2**20  # DCP's index of a checkpoint: kilobytes per tensor
DCP_METADATA_GLOBALS = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout (by its name)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }
)
"""(module, name) of every global a DCP `.metadata` pickle may name, besides torch's dtypes."""


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `DCP_METADATA_GLOBALS` and torch's dtypes."""

    def __init__(self, handle: Any, source: Path) -> None:
        super().__init__(handle)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.source}: names {module}.{name}, which DCP checkpoint metadata never holds (not written by "
            "memtrain); refusing to unpickle it: remove this checkpoint or resume from another one"
        )


def read_dcp_metadata(path: Path) -> Metadata:
    """A DCP checkpoint's `.metadata` file, unpickled with the allow-list (`CheckpointError` naming it)."""
    try:  # a regular file, not a symlink, bounded, never blocking (a FIFO hung resume under the lock)
        data = jsonfile.read_regular_file(path, MAX_DCP_METADATA_BYTES)
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated or foreign bytes: any of pickle's and the classes' errors
        raise CheckpointError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


def only_regular_files(source: Path, writer: str, *, folders: bool = True) -> None:
    """`CheckpointError` naming the first entry under `source` that is not a regular file (nor, with
    `folders`, a folder): a FIFO, a device, a socket, a symlink. `writer` (DCP, DeepSpeed) opens its files
    plainly, so a FIFO would block the read forever (under the run's lock on resume) and a symlink would read
    outside the run. DCP writes one flat folder (`folders=False`), DeepSpeed a tree."""
    for folder, inner, files in os.walk(source):  # os.walk lists a symlinked folder, never enters it
        for name in sorted([*inner, *files]):
            entry = Path(folder) / name
            mode = entry.lstat().st_mode
            if not (stat.S_ISREG(mode) or (folders and stat.S_ISDIR(mode))):
                raise CheckpointError(
                    f"{entry}: not a regular file ({writer} writes only files); remove this checkpoint"
                )


class SafeFileSystemReader(FileSystemReader):
    """torch's `FileSystemReader` whose metadata is read by `read_dcp_metadata`, not `pickle.load`.

    Build it with `checked` (metadata read once up front): DCP's loader catches a failed metadata read,
    logs it with its traceback and tries per-rank metadata files before it fails with a message of its own.
    """

    @classmethod
    def checked(cls, source: Path) -> SafeFileSystemReader:
        reader = cls(str(source))
        read_dcp_metadata(Path(reader._get_metadata_path()))  # one line naming the file, before DCP runs
        only_regular_files(
            source, "DCP", folders=False
        )  # DCP opens its data files plainly: a FIFO would block it
        return reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeBytes:
    """`load_bytes` of a DCP load planner with `weights_only=True` (torch's loads them with full pickle)."""

    source: Path
    flatten_state_dict: bool
    original_state_dict: Any
    mappings: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_weights_only(value, f"{self.source} (item {fqn})")
        if self.flatten_state_dict:  # where torch's DefaultLoadPlanner.load_bytes puts the item
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner, byte items loaded with `weights_only=True`; `source` names the files."""

    def __init__(self, source: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source = source


class SafeEmptyStateDictLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner that rebuilds the state from the metadata, byte items loaded with `weights_only=True`."""

    def __init__(self, source: Path, keys: set[str] | None = None) -> None:
        super().__init__(keys=keys)
        self.source = source


def dcp_failure(exc: BaseException) -> BaseException:
    """The first error inside DCP's `CheckpointException` (it wraps each rank's error with its traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for inner, _trace in failures.values():
            return inner  # type: ignore[no-any-return]
    return exc


# ------------------------------------------------------------------------------------- DeepSpeed


def deepspeed_globals() -> list[Any]:
    """The classes DeepSpeed's ZeRO checkpoint files hold beyond tensors and builtins."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_file(path: str | Path, map_location: Any = None, mmap: bool | None = None) -> Any:
    """A DeepSpeed checkpoint file, `weights_only=True` with `deepspeed_globals` allowed."""
    with torch.serialization.safe_globals(deepspeed_globals()):
        return load_weights_only(path, str(path), map_location, mmap)


@contextlib.contextmanager
def deepspeed_reads_safely(engine: Any) -> Iterator[None]:
    """While it lasts, `engine` (a DeepSpeedEngine) reads checkpoint files through `load_deepspeed_file`."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):  # type: ignore[misc]
        def load(self, path: str, map_location: Any = None) -> Any:
            return load_deepspeed_file(path, map_location)

    own = engine.checkpoint_engine
    engine.checkpoint_engine = SafeCheckpointEngine(engine._config)
    try:
        yield
    finally:
        engine.checkpoint_engine = own


class _TorchLoadingSafely(types.ModuleType):
    """torch, seen through one module's global name, whose `load` is `load_deepspeed_file`."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.load: Callable[..., Any] = self._load

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _load(file: Any, map_location: Any = None, *, mmap: bool | None = None, **_: Any) -> Any:
        return load_deepspeed_file(file, map_location, mmap)


@contextlib.contextmanager
def zero_to_fp32_reads_safely() -> Iterator[Any]:
    """`deepspeed.utils.zero_to_fp32`, its files read by `load_deepspeed_file` while the block runs."""
    from deepspeed.utils import zero_to_fp32

    own = zero_to_fp32.torch
    zero_to_fp32.torch = _TorchLoadingSafely()
    try:
        yield zero_to_fp32
    finally:
        zero_to_fp32.torch = own
