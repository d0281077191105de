"""Storages resized in place, told to the trackers that count them.

Why: FSDP2 frees a layer's gathered parameters by resizing their storages to 0 bytes
(`free_storage` after its reshard) and grows them back before the next all-gather (`alloc_storage`); the
storages' Python objects live on, and no aten op runs, so a dispatch mode sees neither. A tracker that
counted each storage once, at its size when first seen, kept every layer's gathered weights alive after
their reshard: on a 4-block FSDP 2 x TP 2 rank trace, three stale layers at the peak (2.6 MB of 30 MB), at
a 70B model's 80 layers x 0.2 GiB 16 GiB. A CUDA device frees those bytes (memory_allocated drops).
`torch.UntypedStorage.resize_` is wrapped while a tracker is open, and each open tracker's ledger
re-reads the storage's size after the call (`StorageLedger.resized`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Listener = Callable[[torch.UntypedStorage], None]

_listeners: list[Listener] = []
_original = torch.UntypedStorage.resize_


def _resize(self: torch.UntypedStorage, size: int) -> torch.UntypedStorage:
    out = _original(self, size)
    for listener in list(_listeners):
        listener(self)
    return out


def listen(listener: Listener) -> None:
    """Call `listener(storage)` after every in-place storage resize until `unlisten`."""
    if not _listeners:
        torch.UntypedStorage.resize_ = _resize  # type: ignore[method-assign,assignment]
    _listeners.append(listener)


def unlisten(listener: Listener) -> None:
    _listeners.remove(listener)
    if not _listeners:
        torch.UntypedStorage.resize_ = _original  # type: ignore[method-assign]
