"""Pipeline parallelism over the mesh's `pp` dimension: the model split into stages, run by torch's schedules.

Why this shape: which part of a model a stage keeps is the model's business, so a trainer hands in its split
(`Trainer.pipeline_split`; the built-in causal-LM trainer's is `memtrain.causal_lm.pipeline`), applied first
in `apply_strategies` (before tensor parallel, checkpointing and FSDP, which then see only the stage's part).
What is the same for every model lives here: the stage (torch's `PipelineStage` over the mesh's `pp` group,
attached once the sharding has wrapped the model, so FSDP's gradient sync is left to the last micro-batch)
and one step of the recipe's schedule (`strategies.mesh.pp_schedule`: GPipe or 1F1B) over the step's
micro-batches, which the trainer's micro-batching made as without a pipeline.

Exact accumulation is kept as in `Trainer._micro_step`: the last stage's loss per micro-batch is the sum of
its token losses (the loss strategy bound to the model) times the step's scale (`grad_sync_scale /
global_tokens`), and the schedule does not divide gradients by the micro-batch count (`scale_grads=False`).
Only the last stage has the loss: `run_step` broadcasts its sum over the stage group, so every stage holds
the step's loss sum as every tensor rank does, and the data-parallel sum counts it once per stage, as it
counts token sums. The gradient norm over parameters spread over stages is summed over that group too
(`stage_group`, read by `clip_grad_norm`).

Micro-batches are padded to one shape (rows and columns: ignored labels, which add nothing to the loss or
the gradients; a causal model's real tokens never attend to the padding after them), as a stage passes
tensors of one shape: the largest any rank has had so far, agreed each step, so a larger step rebuilds every
stage at once. Each stage is built with its tensors' shapes (static `input_args`/`output_args`): the token
ids' for the first stage's input, and between stages the micro-batch's rows and columns times what the
split says a stage hands the next (`PipelineSplit`), in the dtype the stages compute in. Left to infer
them, torch would run a forward and backward of the first micro-batch on every stage and send the shapes
to the next stage as pickled objects, which torch's fake process group cannot carry: the planner's rank
trace runs this step as one rank of that group (`memtrain.training.rank_trace`), where the schedule's own
recv buffers (one per micro-batch, from the stage's build on) and in-flight micro-batches are what the
tracker counts, as in the run. The pipeline does not enter the precision's autocast
(its schedule runs forwards and backwards interleaved; FSDP2's mixed-precision policy casts the compute),
and an out-of-memory error in it is not redone with another plan. torch.distributed.pipelining is
imported only when a run has pp > 1.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.strategies.loss import bound_loss

PipelineSplit = Callable[[nn.Module, int, int], tuple[int, ...] | None]
"""(model, stage, stages) -> keep stage `stage`'s part of `model` in place and return the shape, past the
micro-batch's rows and columns, of the tensor a stage hands the next (a causal LM's: its hidden width);
None: the model cannot split."""
Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100
INPUT, TARGET = "input_ids", "labels"  # the batch keys a stage reads (the causal-LM trainer's)


def split_for_stage(
    model: nn.Module, blocks: list[nn.Module], split: PipelineSplit | None, env: DistEnv, sharding: str
) -> tuple[int, ...]:
    """Keep this rank's stage of `model` (in place) and, in `blocks`, the blocks it still holds; the shape
    past rows and columns of what a stage hands the next. `Unsupported` naming the key when the trainer has
    no split, the model cannot split or the sharding (`sharding`: its checkpoint format) would save one
    stage's parameters only."""
    stage, stages = env.shape.coordinates(env.rank)["pp"], env.shape.pp
    if sharding != "dcp":
        raise Unsupported(
            f"strategies.sharding: pipeline stages (strategies.mesh.pp={stages}) hold different parameters, "
            "which only FSDP2's sharded checkpoints keep; set strategies.sharding=zero3 or zero2"
        )
    handed = split(model, stage, stages) if split is not None else None
    if handed is None:
        owner = type(getattr(split, "__self__", None)).__name__ if split is not None else "the trainer"
        raise Unsupported(
            f"strategies.mesh.pp: {owner} cannot split this model into pipeline stages (the built-in "
            "causal-LM trainer splits transformers models of embed_tokens, layers, norm and lm_head); set "
            "strategies.mesh.pp: 1"
        )
    held = {id(module) for module in model.modules()}
    blocks[:] = [block for block in blocks if id(block) in held]
    return handed


@dataclass
class Pipeline:
    """A stage's model, its place in the pipeline, the shape and dtype past rows and columns of what a stage
    hands the next, and what one step's loss function records."""

    model: nn.Module
    env: DistEnv
    group: dist.ProcessGroup
    schedule_name: str
    handed: tuple[int, ...]
    dtype: torch.dtype
    scale: float = 0.0
    loss_sums: list[torch.Tensor] = field(default_factory=list)
    built: tuple[tuple[int, ...], Any] | None = None  # (micro-batch shape and count, schedule)

    @property
    def stage(self) -> int:
        return self.env.shape.coordinates(self.env.rank)["pp"]

    @property
    def last(self) -> bool:
        return self.stage == self.env.shape.pp - 1

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its summed token losses, scaled for the step."""
        loss_sum = bound_loss(self.model)(output, target, IGNORE_INDEX)
        self.loss_sums.append(loss_sum.detach().double())
        return loss_sum * self.scale

    def schedule(self, key: tuple[int, int, int], micro_batches: int) -> Any:
        """The schedule for `micro_batches` micro-batches of `key`'s rows and columns, built (with a new
        stage, told its tensors' shapes) when it changes."""
        if self.built is None or self.built[0] != key:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            rows, columns = key[1:]
            handed = torch.empty(rows, columns, *self.handed, dtype=self.dtype, device="meta")
            handed.requires_grad_()  # its gradient goes back: torch makes a buffer for it only then
            ids = torch.empty(rows, columns, dtype=torch.long, device="meta")
            stage = PipelineStage(
                self.model,
                self.stage,
                self.env.shape.pp,
                self.env.device,
                input_args=ids if self.stage == 0 else handed,
                output_args=handed,  # the last stage's (its loss's input) is never sent: torch counts it only
                group=self.group,
            )
            kind = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            self.built = key, kind(stage, micro_batches, loss_fn=self.loss, scale_grads=False)
        return self.built[1]


_PIPELINES: weakref.WeakKeyDictionary[nn.Module, Pipeline] = weakref.WeakKeyDictionary()


def attach(model: nn.Module, env: DistEnv, handed: tuple[int, ...], dtype: torch.dtype) -> None:
    """Make the (wrapped) stage model `model` a pipeline stage over the mesh's `pp` group, handing the next
    stage tensors of `handed`'s shape past rows and columns in `dtype` (`split_for_stage`'s, the compute
    dtype)."""
    assert env.device_mesh is not None, "apply_strategies builds the run's device mesh"
    if bound_loss(model).strategy.applies_bare_head:
        raise Unsupported(
            f"strategies.loss: {bound_loss(model).strategy.name} with pipeline stages: the last stage "
            "computes the loss from the logits; set strategies.loss=standard"
        )
    group = env.device_mesh["pp"].get_group()
    _PIPELINES[model] = Pipeline(model, env, group, env.shape.pp_schedule, handed, dtype)


def is_pipeline(model: nn.Module | None) -> bool:
    return model is not None and model in _PIPELINES


def stage_group(model: nn.Module | None) -> dist.ProcessGroup | None:
    """The process group of `model`'s pipeline stages (None without a pipeline)."""
    found = _PIPELINES.get(model) if model is not None else None
    return found.group if found is not None else None


def run_step(model: nn.Module, micro_batches: list[Batch], scale: float) -> torch.Tensor:
    """Forward and backward of the step's micro-batches through the pipeline, gradients left in `.grad`;
    the step's summed token losses (float64), the same on every stage."""
    pipeline = _PIPELINES[model]
    count, rows, columns = _agreed_shape(pipeline, micro_batches)
    padded = _padded(micro_batches, count, rows, columns)
    schedule = pipeline.schedule((count, rows, columns), count)
    pipeline.scale, pipeline.loss_sums = scale, []
    extra = {k: v for k, v in padded.items() if k not in (INPUT, TARGET, "sample_ids")}
    inputs = (padded[INPUT],) if pipeline.stage == 0 else ()
    schedule.step(*inputs, target=padded[TARGET] if pipeline.last else None, **extra)
    device = pipeline.env.device
    total = torch.stack(pipeline.loss_sums).sum() if pipeline.last else torch.zeros((), device=device)
    total = total.to(device=device, dtype=torch.float64)
    last_rank = dist.get_global_rank(pipeline.group, pipeline.env.shape.pp - 1)
    dist.broadcast(total, src=last_rank, group=pipeline.group)
    return total


def _agreed_shape(pipeline: Pipeline, micro_batches: list[Batch]) -> tuple[int, int, int]:
    """Micro-batches per step, rows and columns every rank pads to: the largest of any rank's this step and
    of the stage's so far. Every rank then rebuilds its stage at the same step (a stage receives into
    buffers of the shape it was built with, which must be the shape its neighbour sends), and only when a
    step is larger."""
    mine = [len(micro_batches), *(max(mb[INPUT].shape[dim] for mb in micro_batches) for dim in (0, 1))]
    agreed = torch.tensor(mine, dtype=torch.long, device=pipeline.env.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    before = pipeline.built[0] if pipeline.built is not None else (0, 0, 0)
    count, rows, columns = (max(int(a), b) for a, b in zip(agreed.tolist(), before, strict=True))
    return count, rows, columns


def _padded(micro_batches: list[Batch], count: int, rows: int, columns: int) -> Batch:
    """`count` micro-batches stacked (the schedule splits them again), each padded to `rows` x `columns`
    (labels with `IGNORE_INDEX`, the rest with 0); missing ones are all padding (no loss token)."""
    blank = {k: torch.zeros_like(v[:0]) for k, v in micro_batches[0].items()}
    out: dict[str, list[torch.Tensor]] = {}
    for mb in [*micro_batches, *[blank] * (count - len(micro_batches))]:
        for key, value in mb.items():
            if value.dim() != 2 or value.shape[0] != mb[INPUT].shape[0]:
                continue
            fill = IGNORE_INDEX if key == TARGET else 0
            pad = (0, columns - value.shape[1], 0, rows - value.shape[0])
            out.setdefault(key, []).append(F.pad(value, pad, value=fill))
    return {key: torch.cat(values) for key, values in out.items()}
