"""Sharded checkpoints (torch.distributed.checkpoint) and moving states between checkpoint formats.

Why DCP: with zero2/zero3 no rank holds the whole model, and gathering it to rank 0 to write one file
costs the memory that sharding saved. DCP writes every rank's shards in parallel, with a global
metadata file that records each tensor's global shape. Loading plans reads by that metadata, so a
checkpoint written on 2 ranks loads on 1 or 4 (resharding), and into an unsharded model.

The files go into the checkpoint's staging directory (`<step>.tmp/dcp/`), so the atomic
staging-then-rename of `memtrain.checkpoint` covers them too.

Three formats live side by side; a checkpoint's manifest (its meta.json's `format`, which the backend's
`checkpoint_format` fills) names the one it holds, and `detect_format` checks the files against it:
- `replicated`: `model.pt` / `optimizer.pt` written by rank 0 (none, ddp, zero1);
- `dcp`: `dcp/` (zero2 / zero3 on FSDP2), model and optimizer keyed by parameter name;
- `deepspeed`: `deepspeed/`, DeepSpeed's own layout (it resumes only under DeepSpeed).
Files of another format next to the declared one were not written by memtrain and are refused unread (a
planted `deepspeed/` folder must never reach DeepSpeed's loader). A checkpoint written before manifests
is detected from its files, as it always was. DCP files are read through `safe_readers` (no pickle).

`load_sharded` loads a dcp checkpoint into any model/optimizer the DCP state-dict helpers understand
(FSDP2 or plain), and a replicated checkpoint into an FSDP2 model (each rank reads the full files and
keeps its shards), so none/ddp checkpoints resume under zero3 and back.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from memtrain import checkpoint as ckpt

Format = Literal["replicated", "dcp", "deepspeed"]
FORMATS: tuple[Format, ...] = ("replicated", "dcp", "deepspeed")
DCP_DIR = "dcp"
DEEPSPEED_DIR = "deepspeed"
MANIFEST_KEY = "format"  # the key of a checkpoint's meta.json that names its format (the trainer writes it)
# What holds each format's files: the one its detection needs first, then any other it may hold.
FORMAT_FILES: dict[Format, tuple[str, ...]] = {
    "replicated": ("model.pt", "optimizer.pt"),
    "dcp": (DCP_DIR,),
    "deepspeed": (DEEPSPEED_DIR,),
}


def detect_format(path: Path, declared: object = None) -> Format:
    """The format of checkpoint `path`: `declared` (its manifest's), checked against its files, or for a
    checkpoint without one (written before manifests), the first format whose files it holds."""
    if declared is None:
        return _detected(path)
    if declared not in FORMATS:
        raise ckpt.CheckpointError(
            f"{path}: its meta.json names the checkpoint format {declared!r}, not one of {', '.join(FORMATS)} "
            "(not written by memtrain)"
        )
    own = FORMAT_FILES[declared]  # type: ignore[index]
    if not os.path.lexists(path / own[0]):
        raise ckpt.CheckpointError(
            f"{path / own[0]}: missing, though the checkpoint's meta.json says it is a {declared} checkpoint "
            "(incomplete checkpoint)"
        )
    for name in (n for fmt in FORMATS if fmt != declared for n in FORMAT_FILES[fmt]):
        if os.path.lexists(path / name):
            raise ckpt.CheckpointError(
                f"{path / name}: not part of this {declared} checkpoint (its meta.json says {declared}), so not "
                "written by memtrain; it is not read: remove it, or resume from another checkpoint"
            )
    return declared  # type: ignore[return-value]


def _detected(path: Path) -> Format:
    if (path / "model.pt").is_file():
        return "replicated"
    if (path / DCP_DIR / ".metadata").is_file():
        return "dcp"
    if (path / DEEPSPEED_DIR).is_dir():
        return "deepspeed"
    raise ckpt.CheckpointError(
        f"{path}: holds neither model.pt, {DCP_DIR}/ nor {DEEPSPEED_DIR}/ (incomplete checkpoint)"
    )


def dcp() -> types.ModuleType:
    """torch.distributed.checkpoint (with its `state_dict` helpers), imported when a sharded checkpoint is
    written or read: it imports FSDP (seconds), which `memtrain validate` and replicated runs never use."""
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint.state_dict

    return torch.distributed.checkpoint


def save_sharded(staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of model and optimizer into `staging/dcp` (collective)."""
    model_state, optim_state = dcp().state_dict.get_state_dict(model, optimizer)
    dcp().save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging / DCP_DIR))


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a dcp or replicated checkpoint into `model` and `optimizer` (collective when distributed)."""
    found = detect_format(path)
    if found == "deepspeed":
        raise ckpt.CheckpointError(
            f"{path}: written by DeepSpeed; resume it with strategies.sharding_backend=deepspeed and the same "
            "world size"
        )
    if found == "replicated":
        _load_replicated(path, model, optimizer)
        return
    from memtrain.strategies.sharding import safe_readers  # built on torch.distributed.checkpoint

    # The templates say what to read; get_state_dict gives the optimizer its (empty) states first.
    helpers = dcp().state_dict
    model_state, optim_state = helpers.get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    source = path / DCP_DIR
    try:
        dcp().load(
            state,
            storage_reader=safe_readers.SafeFileSystemReader.checked(source),
            planner=safe_readers.SafeLoadPlanner(source),
        )
    except (
        Exception,
        dcp().api.CheckpointException,
    ) as exc:  # CheckpointException derives from BaseException
        failure = safe_readers.dcp_failure(exc)
        if isinstance(failure, ckpt.CheckpointError):
            raise failure from None
        raise ckpt.CheckpointError(
            f"{source}: cannot be loaded into this model ({ckpt.describe(failure)})"
        ) from None
    helpers.set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _load_replicated(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Full `model.pt` / `optimizer.pt` (keyed by parameter index) into a possibly sharded model."""
    helpers = dcp().state_dict
    full = helpers.StateDictOptions(full_state_dict=True)
    try:
        helpers.set_model_state_dict(model, ckpt.load_tensor_file(path / "model.pt"), options=full)
    except (RuntimeError, KeyError) as exc:
        raise ckpt.CheckpointError(f"{path / 'model.pt'}: does not fit this model ({exc})") from None
    by_index = ckpt.load_tensor_file(path / "optimizer.pt")
    by_name = _keyed_by_name(by_index, model, optimizer)
    helpers.set_optimizer_state_dict(model, optimizer, by_name, options=full)


def _keyed_by_name(
    state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """An optimizer state_dict keyed by parameter index, re-keyed by parameter name.

    Indices count the parameters of the optimizer's groups in order, so the i-th parameter of this
    optimizer (built by the same factory) names the i-th saved entry.
    """
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = sum(len(group["params"]) for group in state["param_groups"])
    if saved != len(order):
        raise ckpt.CheckpointError(f"optimizer.pt: holds {saved} parameters, this optimizer has {len(order)}")
    groups = []
    start = 0
    for group in state["param_groups"]:
        count = len(group["params"])
        groups.append({**group, "params": order[start : start + count]})
        start += count
    return {
        "state": {order[int(index)]: value for index, value in state["state"].items()},
        "param_groups": groups,
    }
