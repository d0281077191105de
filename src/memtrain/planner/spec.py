"""`ModelSpec`: what the planner knows of the job the trainer will run, as the trainer's own functions.

Why functions and not a config: the prediction must be of the job the user actually runs — their
`Trainer` subclass's model, batches and loss. The trainer hands the planner its hooks (`build_model`,
`blocks`, a micro-batch of the shape it will feed, `loss`), and the planner calls them on the meta device
or under fake tensors. The planner therefore never imports a trainer or a model library; the built-in
causal-LM trainer is one subclass among others.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain.errors import MemtrainError
from memtrain.planner.expert_parallel import ExpertRouting

Batch = dict[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], tuple[torch.Tensor, Any]]


def loss_output(out: object, name: str = "Trainer.loss") -> tuple[torch.Tensor, Any]:
    """`out`, a `loss` hook's return value, if it is `(loss_sum, num_tokens)` with a 0-dim tensor first;
    else a one-line error naming `name` (a bare tensor, a dict or a Python float would otherwise fail deep
    in a trace or a step)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) and not out[0].dim():
        return out
    if isinstance(out, tuple):
        got = f"a tuple of {len(out)}: " + ", ".join(type(v).__name__ for v in out)
    else:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
    raise MemtrainError(
        f"{name} must return (loss_sum, num_tokens): the loss summed over the micro-batch's tokens as a 0-dim "
        f"tensor, and how many tokens it sums; it returned {got}"
    )


@dataclass(frozen=True)
class ModelSpec:
    """The trainer's job as the planner sees it.

    build_model: the trainer's `build_model` (called on the meta device and under fake tensors).
    blocks: the trainer's `blocks(model)`, the repeated blocks strategies wrap.
    micro_batch: `rows` -> a micro-batch of that many rows, of the largest shape the trainer feeds (real
        CPU tensors; the planner makes fake copies).
    loss: the trainer's `loss(model, micro_batch)`.
    build_clone: `depth` -> the same model with `depth` blocks, when the trainer can build one (traces of a
        deep model then cost three blocks); None: the planner traces the whole model.
    host_bytes: -> bytes of data the trainer keeps in host memory (asked only when the device is a CPU,
        where host memory is the device).
    name: what to call the model in progress lines and errors.
    frozen_bytes: the forward's compute dtype -> bytes of frozen weights the trainer keeps beside the model
        on every rank (a DPO reference copy, `causal_lm.preference`): weights in every plan's prediction.
    reference_forwards: forwards of a frozen copy of the model (no backward) each row also runs (a DPO
        reference, the adapter-free base included): in the step-time prediction.
    trace_key: a value that determines everything the hooks above do in a trace: two specs with equal keys
        build the same model and clones, cut the same blocks, make the same micro-batches and compute the
        same loss. Set only where that holds (the built-in causal-LM trainer with its own hooks: its
        config and the recipe's `model` and `data` sections); None, the default: this spec's traces are
        never shared with another probe's (`model_probe.shared_traces`).
    tensor_parallel_problems: `tp` -> why the model cannot be split over that many tensor ranks (empty when
        it can); None: the trainer has no tensor-parallel plan (the mesh search keeps tp at 1).
    pipeline: whether the trainer can split its model into pipeline stages (`Trainer.pipeline_split`);
        False: the mesh search keeps pp at 1.
    rebuild: how a new process builds the same trainer: its class as `module:Class` or `file.py:Class` and
        the recipe as a dict, both JSON (the rank trace of a mesh runs in a process of its own:
        `planner/rank_trace.py`). None: it cannot (a mesh is then predicted by formula).
    experts: a mixture-of-experts model's routing (experts per layer, per token, the sizes a routed row
        keeps): the mesh search's expert-parallel degrees and the busiest ep rank's load
        (planner/expert_parallel.py). None: a dense model (ep stays 1).
    """

    build_model: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], list[nn.Module]]
    micro_batch: Callable[[int], Batch]
    loss: LossFn
    build_clone: Callable[[int], nn.Module] | None = None
    host_bytes: Callable[[], int] = lambda: 0
    name: str = "model"
    frozen_bytes: Callable[[torch.dtype], int] = lambda _dtype: 0
    reference_forwards: int = 0
    trace_key: Hashable | None = None
    tensor_parallel_problems: Callable[[int], list[str]] | None = None
    pipeline: bool = False
    rebuild: tuple[str, Mapping[str, Any]] | None = None
    experts: ExpertRouting | None = None
