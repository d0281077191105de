"""One rank of a mesh, traced: the trainer's own step on fake tensors over torch's fake process group.

Why the trainer's own step: on a mesh, what a rank holds is what FSDP2's shards and gathers, the
tensor-parallel plan (which pieces are split, which come back whole: the embedding's gradient, the norms),
sequence parallelism and the step's collectives make of the model, micro-step by micro-step. A formula per
combination drifts from torch; the step itself cannot. torch's fake process group lets one process be rank
r of N (every collective returns at once with outputs of the right shapes), and fake tensors carry shapes
and storages without memory, so the setup's `apply_plan` and `Trainer.train_step` run here as on the mesh while
the `MemoryTracker` counts every storage, as it counts the run's.

What differs from the run, and why the bytes do not:
- the model is built on the meta device and its strategies applied there (slicing the `DeviceMesh` and
  FSDP2's sharding read tensor values, which fake tensors lack); its parameters are then materialised as
  fake tensors (`apply_strategies(materialise_in=...)`); no weights are read. It is the model the planner's
  single-process trace builds (`ModelSpec.build_model`: a causal LM's `trace_sdpa`, given an all-ones mask),
  as transformers cannot tell from fake position ids that a row is one sequence: the run's model then builds
  no causal mask and keeps grouped-query keys and values unexpanded, which the trainer's own `build_model`
  traced would not (6 KB per layer and micro-batch over, x4 under GPipe: 3.4%);
- the step batch is `planning_batch(rows)` (the longest rows, what the planner predicts every plan for),
  split as the trainer splits it before the fake mode starts (the split reads the rows' lengths). Those
  tensors and what the step makes of them alone (a pipeline's padded copy) are real host tensors, which a
  CPU run's tracker counts (host memory is its device), so the trace's tracker counts real CPU storages
  besides its fake ones for a CPU run (`MemoryTracker(host=True)`: 4.2 KB of `other` under without);
- values the step reads keep them where they come from the batch and are placeholders where they come
  from fake tensors (`memtrain.memory.HostValues`);
- a 4-bit base (QLoRA) cannot be quantised here (bitsandbytes reads real values; the model is meta, then
  fake), so its linears are `PackedLinear`s (`FourBit.packed_stand_in`): the packed uint8 weight FSDP2
  shards and gathers, the quantisation state's bytes as a buffer kept whole, the dequantised copy made per
  forward and backward; int8 is not traced (the planner keeps its arithmetic);
- what the run's backend holds that the fake group does not (gloo, the backend of a CPU run: its copy of a
  reduce-scatter's input, an asynchronous collective's or an all-gather's tensors until its worker thread
  lets go of them, a send's tensor while the caller keeps its work) is
  held by `GlooBuffers`, entered when `collective_backend` of the trainer's device is gloo;
- steps 1 .. STEPS run (step 0 checks the loss's token count, which a fake loss has not) and the last
  one's report is the rank's step: the optimizer states exist from the end of the first;
- a pipeline stage runs torch's schedule as in the run: its sends return at once (their tensors held by
  `GlooBuffers` for a gloo run) and its receives leave their buffers as they are, which is all the step needs of them, as the stage is built with the shapes it
  exchanges (`memtrain.strategies.pipeline`; torch's vote on whether every stage has them reads a fake
  value, which `HostValues` reads as 1: yes): its receive buffers, one per micro-batch, and the
  micro-batches the schedule keeps in flight are what the tracker counts, as on the mesh.

The caller joins the fake group first, in a process of its own (the group is process-global):
`memtrain.commands.rank_trace`, which the planner starts (`memtrain.planner.rank_trace`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from memtrain.distributed import collective_backend
from memtrain.errors import Unsupported
from memtrain.memory import HostValues, MemoryTracker, StepMemory, fake_tensors_with_real_inputs
from memtrain.memory.gloo_buffers import GlooBuffers
from memtrain.plan import Plan
from memtrain.training.applying import apply_plan
from memtrain.training.trainer import Trainer

STEPS = 2


def trace_step(trainer: Trainer, plan: Plan, rows: int | None = None) -> StepMemory:
    """The tracker's report of one step of `plan` on this process's rank of the fake process group
    (`rows`: the data-parallel rank's rows per step; default the recipe's); `Unsupported` for a plan
    its sharding refuses on the mesh."""
    if plan.quantization.name != "none" and plan.quantization.bits != 4:  # before anything is built
        raise Unsupported(
            f"model.quantization: {plan.quantization.name} is not traced per rank (only the 4-bit formats have "
            "the rank trace's stand-in); the planner keeps its arithmetic"
        )
    env = dataclasses.replace(
        trainer.env, rank=dist.get_rank(), world_size=plan.shape.size, mesh=plan.shape, device_mesh=None
    )
    trainer.env = trainer.monitor.env = env
    trainer.plan, trainer.sharding = plan, plan.sharding_backend(trainer.recipe.train.grad_clip)
    trainer.sharding.check(env)
    mode = fake_tensors_with_real_inputs()
    with torch.device("meta"):
        model = trainer.model_spec().build_model()  # as the planner traces it (`CausalLMTrainer.model_spec`)
    applied, _ = apply_plan(trainer, model, materialise_in=mode)
    host = env.device.type == "cpu"  # a CPU run's tracker counts its real batch: host memory is its device
    tracker = MemoryTracker(trainer.sharding.unwrap(applied.model), applied.optimizer, host=host)
    trainer.model, trainer.optimizer, trainer.scaler = applied.model, applied.optimizer, applied.grad_scaler
    trainer.monitor.tracker = tracker
    batch = trainer.planning_batch(rows or trainer.per_rank_batch_size)
    micro_batches = trainer.split_batch(batch, plan.micro_batch_size)
    try:
        with (
            _feeding(trainer, batch, micro_batches),
            mode,
            tracker,
            HostValues(),
            _backend_buffers(env.device),
        ):
            for step in range(1, STEPS + 1):
                trainer.train_step(step)
        return tracker.reports[-1]
    finally:
        trainer.model = trainer.optimizer = trainer.scaler = None
        trainer.monitor.tracker = None
        gc.collect()


def _backend_buffers(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """What the run's process-group backend holds beyond the fake group, for the tracker to count (entered
    after it): gloo's buffers on a gloo device, nothing for NCCL (`memtrain.memory.gloo_buffers`)."""
    return GlooBuffers() if collective_backend(device) == "gloo" else contextlib.nullcontext()


@contextlib.contextmanager
def _feeding(trainer: Trainer, batch: dict[str, torch.Tensor], micro_batches: list[Any]) -> Iterator[None]:
    """While open, every step of `trainer` reads `batch`, split into `micro_batches` (the hooks shadowed in
    the instance's own attributes, removed on exit)."""
    shadowed: dict[str, Any] = {
        "step_batch": lambda _step: batch,
        "split_batch": lambda _batch, _size: micro_batches,
    }
    vars(trainer).update(shadowed)
    try:
        yield
    finally:
        for name in shadowed:
            del vars(trainer)[name]
