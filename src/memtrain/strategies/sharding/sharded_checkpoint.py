"""Sharded checkpoints (torch.distributed.checkpoint) and moving states between checkpoint formats.

Why DCP: with zero2/zero3 no rank holds the whole model, and gathering it to rank 0 to write one file
costs the memory that sharding saved. DCP writes every rank's shards in parallel, with a global
metadata file that records each tensor's global shape. Loading plans reads by that metadata, so a
checkpoint written on 2 ranks loads on 1 or 4 (resharding), and into an unsharded model.

The files go into the checkpoint's staging directory (`<step>.tmp/dcp/`), so the atomic
staging-then-rename of `memtrain.checkpoint` covers them too.

Three formats live side by side; `detect_format` tells them apart:
- `replicated`: `model.pt` / `optimizer.pt` written by rank 0 (none, ddp, zero1);
- `dcp`: `dcp/` (zero2 / zero3 on FSDP2), model and optimizer keyed by parameter name;
- `deepspeed`: `deepspeed/`, DeepSpeed's own layout (it resumes only under DeepSpeed).

`load_sharded` loads a dcp checkpoint into any model/optimizer the DCP state-dict helpers understand
(FSDP2 or plain), and a replicated checkpoint into an FSDP2 model (each rank reads the full files and
keeps its shards), so none/ddp checkpoints resume under zero3 and back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from memtrain import checkpoint as ckpt

Format = Literal["replicated", "dcp", "deepspeed"]
DCP_DIR = "dcp"
DEEPSPEED_DIR = "deepspeed"


def detect_format(path: Path) -> Format:
    if (path / "model.pt").is_file():
        return "replicated"
    if (path / DCP_DIR / ".metadata").is_file():
        return "dcp"
    if (path / DEEPSPEED_DIR).is_dir():
        return "deepspeed"
    raise ckpt.CheckpointError(
        f"{path}: holds neither model.pt, {DCP_DIR}/ nor {DEEPSPEED_DIR}/ (incomplete checkpoint)"
    )


def save_sharded(staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of model and optimizer into `staging/dcp` (collective)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging / DCP_DIR))


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
    # The templates say what to read; get_state_dict gives the optimizer its (empty) states first.
    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path / DCP_DIR))
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        raise ckpt.CheckpointError(f"{path / DCP_DIR}: cannot be loaded into this model ({exc})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _load_replicated(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Full `model.pt` / `optimizer.pt` (keyed by parameter index) into a possibly sharded model."""
    full = StateDictOptions(full_state_dict=True)
    try:
        set_model_state_dict(model, ckpt.load_tensor_file(path / "model.pt"), options=full)
    except (RuntimeError, KeyError) as exc:
        raise ckpt.CheckpointError(f"{path / 'model.pt'}: does not fit this model ({exc})") from None
    by_index = ckpt.load_tensor_file(path / "optimizer.pt")
    set_optimizer_state_dict(model, optimizer, _keyed_by_name(by_index, model, optimizer), options=full)


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
