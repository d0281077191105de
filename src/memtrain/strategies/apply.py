"""`apply_strategies`: the one place a plan's strategies are applied to a model, in one fixed order.

The order (as torchtitan's parallelize does it): adapters (LoRA layers added, the base frozen) ->
precision module swaps (fp8's float8 linears) -> [on a mesh: the `DeviceMesh`, built once -> the pipeline
split (this rank's stage, the trainer's `pipeline_split`) -> tensor and sequence parallel (the trainer's
plan, `tensor_parallel`) -> the experts over `ep` (the trainer's `expert_parallel_plan`)] ->
activation checkpointing (wraps the blocks' forwards) -> the loss (binds to the model; `chunked` defers the
output head's forward to it) -> compile (each block, or the model, in place, around the checkpointing's
wrappers: `memtrain.strategies.compile`) -> the precision's stored dtype, frozen parameters in the compute dtype where
the precision and the sharding keep them so (`Precision.frozen_stored_dtype`, `Sharding.as_stored`) ->
[device ->
sharding (wraps the model, may shard or wrap the optimizer) -> materialise pretrained weights where the
plan keeps them -> the optimizer over the trainable parameters, built by the precision (master weights)
around the trainer's `build_optimizer` (one per parameter, stepped in backward, under `optimizer_step:
in_backward`) -> [pp > 1: the wrapped stage attached to its pipeline, `memtrain.strategies.pipeline`]].

The trainer's setup runs all of it; `switch_in_place` re-applies checkpointing, the loss and compile to a
live model when a run re-plans (memtrain.training.replan). The planner's trace runs the model part only (`env=None`), on a model
of fake tensors: the optimizer's states and the sharding's bytes are arithmetic, and what the forward and
backward keep is what the trace measures. Both call this function, so they cannot apply strategies in a
different order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from memtrain.distributed import DistEnv, with_device_mesh
from memtrain.strategies.adapters import Adapters
from memtrain.strategies.blocks import output_head
from memtrain.strategies.checkpointing import Checkpointing, unwrap_blocks
from memtrain.strategies.compile import Compile, uncompile
from memtrain.strategies.expert_parallel import ExpertPlanHook, apply_expert_parallel
from memtrain.strategies.loss import Loss
from memtrain.strategies.optimizer_step import OptimizerStep
from memtrain.strategies.pipeline import PipelineSplit, attach, split_for_stage
from memtrain.strategies.precision import Precision
from memtrain.strategies.quantization import Quantization
from memtrain.strategies.sharding import SHARDING
from memtrain.strategies.sharding.base import ShardingBackend, ensure_process_group
from memtrain.strategies.tensor_parallel import PlanHook, apply_tensor_parallel

OptimizerBuilder = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LoadWeights = Callable[[nn.Module], None]


@dataclass
class Applied:
    """A model with every strategy applied, and what setup built around it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    grad_scaler: torch.amp.GradScaler | None = None


def apply_strategies(
    model: nn.Module,
    blocks: list[nn.Module],
    precision: Precision,
    checkpointing: Checkpointing,
    *,
    sharding: ShardingBackend | None = None,
    env: DistEnv | None = None,
    build_optimizer: OptimizerBuilder | None = None,
    weights_dtype: torch.dtype | None = None,
    load_weights: LoadWeights | None = None,
    adapters: Adapters | None = None,
    quantization: Quantization | None = None,
    loss: Loss | None = None,
    optimizer_step: OptimizerStep | None = None,
    tensor_parallel: PlanHook | None = None,
    pipeline: PipelineSplit | None = None,
    expert_parallel: ExpertPlanHook | None = None,
    materialise_in: contextlib.AbstractContextManager[object] | None = None,
    compile: Compile | None = None,
) -> Applied:
    """Apply the strategies in order. With `env` (training): move to the device, shard, build the
    optimizer. Without (the planner's trace): stop after the model's own strategies. `weights_dtype`
    overrides the dtype the forward reads weights in (sharding backends that hand bf16 weights to a
    bf16-mixed forward).

    A model whose parameters are on the meta device (pretrained weights not read yet) is materialised on
    the device and filled by `load_weights` where its plan keeps the weights: before a replicating
    backend wraps it, or, for a backend that shards meta models (FSDP2), after sharding, so that each
    rank reads only its shards. On a mesh with tp > 1, `tensor_parallel(model)` is the trainer's plan for
    splitting it; with ep > 1, `expert_parallel(model)` lists its experts modules
    (`memtrain.strategies.expert_parallel`); with pp > 1, `pipeline(model, stage, stages)` keeps this rank's stage of it (and `blocks`
    keeps the blocks that stage holds). `materialise_in`: the context a meta model's parameters are
    materialised in (the planner's rank trace: fake tensors, `memtrain.training.rank_trace`)."""
    adapters = adapters or Adapters()
    quantization = quantization or Quantization()
    if quantization.name != "none":  # after the weights are loaded (it reads them), before the adapters
        compute = precision.autocast_dtype or precision.stored_dtype
        head = output_head(model)

        def skip(name: str) -> bool:  # the output head stays unquantised
            return head is not None and name == head

        if env is None:  # the planner's fake tensors: bitsandbytes' layers cannot hold them
            quantization.stand_in(model, skip, compute)
        elif materialise_in is not None:  # the rank trace's meta model: the packed layout, no values
            quantization.packed_stand_in(model, skip, compute)
        elif any(p.is_meta for p in model.parameters()):
            # Quantisation reads every weight, so each rank loads the whole base first: on the device for
            # a replicated plan, on the host under FSDP2 (its layers are quantised onto the device one by
            # one, then sharded), so that the unquantised model never sits on the device whole.
            sharded = sharding is not None and sharding.shards_meta_models
            materialise_parameters(model, torch.device("cpu") if sharded else env.device)
            if load_weights is not None:
                load_weights(model)
        if env is not None and materialise_in is None:
            if all(p.device == env.device for p in model.parameters()):
                quantization.apply(model, skip, compute)
            else:
                quantization.apply(model, skip, compute, device=env.device)
                model.to(env.device)
            setattr(model, f"is_loaded_in_{quantization.bits}bit", True)  # peft's quantised LoRA layers
    adapters.apply(model)
    precision.swap_modules(model, blocks)
    if env is not None and not env.shape.is_flat:  # the mesh, built once for every strategy that needs it
        ensure_process_group(env)
        env = with_device_mesh(env)
    handed: tuple[int, ...] = ()  # what a pipeline stage hands the next, past rows and columns
    if env is not None and env.shape.pp > 1:  # first: every later strategy sees only this stage's part
        handed = split_for_stage(model, blocks, pipeline, env, sharding.checkpoint_format if sharding else "")
    if env is not None and env.shape.tp > 1:
        if not any(p.is_meta for p in model.parameters()):
            model.to(env.device)
        apply_tensor_parallel(model, tensor_parallel, env)
    if env is not None and env.shape.ep > 1:  # the experts split over ep (FSDP2 shards them outside it)
        owner = (
            type(getattr(expert_parallel, "__self__", None)).__name__ if expert_parallel else "the trainer"
        )
        apply_expert_parallel(expert_parallel(model) if expert_parallel else None, env, owner)
    checkpointing.apply(model, blocks)
    head_name = output_head(model)
    (loss or Loss()).apply(model, None if head_name is None else model.get_submodule(head_name))
    (compile or Compile()).apply(model, blocks)  # lazy: traced at the first call, after the casts below
    dtype = weights_dtype or precision.stored_dtype
    # The plan's stored dtype, whatever the model was built in (a hub config's torch_dtype: bfloat16 builds
    # bf16); under fp32 the parameters alone, buffers (rotary tables) as the model keeps them.
    cast_floating(model, dtype, model.parameters() if dtype == torch.float32 else None)
    if weights_dtype is None and sharding is not None and sharding.name in SHARDING:
        precision = SHARDING.get(sharding.name).as_stored(precision)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    cast_floating(model, weights_dtype or precision.frozen_stored_dtype, frozen)
    if env is None:
        return Applied(model)
    assert sharding is not None and build_optimizer is not None
    build = (optimizer_step or OptimizerStep()).wrap_builder(build_optimizer)
    device = env.device

    def materialise(target: nn.Module) -> None:
        with materialise_in or contextlib.nullcontext():
            materialise_parameters(target, device)
        if load_weights is not None:
            load_weights(target)
        adapters.initialise(target)

    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and not sharding.shards_meta_models:
        materialise(model)  # on the device already (a fake-tensor trace's cannot be moved again)
        on_meta = False
    elif not on_meta:
        model = model.to(device)
    wrapped, optimizer = sharding.prepare(
        model,
        blocks,
        env,
        lambda m: precision.build_optimizer(m, build),
        materialise=materialise if on_meta else None,
    )
    if env.shape.pp > 1:  # the stages compute (and hand on) in the precision's forward dtype (FSDP2's casts)
        attach(wrapped, env, handed, precision.autocast_dtype or precision.stored_dtype)
    return Applied(wrapped, optimizer, precision.grad_scaler(device))


def switch_in_place(
    model: nn.Module,
    blocks: list[nn.Module],
    checkpointing: Checkpointing,
    loss: Loss,
    compile: Compile | None = None,
) -> None:
    """Re-apply the strategies a running model can change between steps: its blocks' checkpointing (the old
    wrappers removed first) and the loss binding, then the plan's compile again over the new wrappers (a
    compiled program has the old checkpointing traced into it: the regions are made eager and compiled
    anew, traced at their next call). `model` is the model `apply_strategies` received (not a sharding
    wrapper); parameters, optimizer and sharding are untouched, so the training goes on exactly."""
    uncompile([model, *blocks])
    unwrap_blocks(blocks)
    checkpointing.apply(model, blocks)
    head_name = output_head(model)
    loss.apply(model, None if head_name is None else model.get_submodule(head_name))
    (compile or Compile()).apply(model, blocks)


def materialise_parameters(model: nn.Module, device: torch.device) -> None:
    """Empty storage on `device` for every parameter (uninitialised: the caller fills them), keeping the
    buffers a meta-parameter build left real (rotary tables) and the ties between parameters."""
    buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
    ties = _ties(model)
    model.to_empty(device=device)
    for name, buffer in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = buffer.to(device)
    for name, first in ties.items():  # `Module.to_empty` gives each name of a tied parameter its own tensor
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(first))


def _ties(model: nn.Module) -> dict[str, str]:
    """Each later name of a parameter -> its first name."""
    first: dict[int, str] = {}
    ties = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
    return ties


def cast_floating(
    model: nn.Module, dtype: torch.dtype, tensors: Iterable[torch.Tensor] | None = None
) -> None:
    """Floating parameters and buffers (or those of `tensors`) to `dtype`, in place (the same Parameter
    objects, as `Module.to` keeps them; done through `.data` because fake tensors refuse `Module.to`'s
    parameter swap)."""
    chosen = (*model.parameters(), *model.buffers()) if tensors is None else tuple(tensors)
    with torch.no_grad():
        for tensor in chosen:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
