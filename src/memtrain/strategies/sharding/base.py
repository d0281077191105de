"""How the model and its states are laid out across data-parallel ranks: the backend interface.

The trainer talks to every layout through `ShardingBackend`. A backend wraps the model, may wrap the
optimizer, decides when gradients are synchronised across micro-steps, runs backward, and saves and
loads its own checkpoint files. `none` and `ddp` live here. The ZeRO stages live in their own modules;
the strategies that build them, and their registry, are in `memtrain.strategies.sharding`.

`ddp` keeps a full replica on each rank and all-reduces (averages) gradients after the last micro-step
of each step. Earlier micro-steps run under `no_sync`, so accumulation costs one all-reduce per step.

Each backend says which choices it can honour: `offloads()` (what `sharding_offload` may move to the host)
and `reductions()` (when gradients are reduced under accumulation, `gradient_reduction`: `per_step`, once
after the last micro-step, or `per_micro_step`, after each; its own behaviour first). A choice outside
them is `Unsupported` naming the key; `auto` takes the backend's own (the planner offers every one).
The trainer divides the loss by the global token count and multiplies by `grad_sync_scale`, which undoes
the backend's averaging. The result is the exact gradient of the global token mean.

A backend is built from the recipe's flat sharding options and the plan facts it needs
(`ShardingOptions`): its precision (FSDP2's dtypes, DeepSpeed's config), micro-batch and accumulation
(DeepSpeed's batch bookkeeping) and clipping (DeepSpeed clips inside its own step). `estimate` is the
per-rank byte arithmetic of `sharding_bytes`; it follows what each backend really allocates.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import memtrain.strategies.sharding.ddp_hooks as ddp_hooks
from memtrain import checkpoint as ckpt
from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.memory.footprint import Footprint, ModelShape
from memtrain.strategies.sharding.state_bytes import (
    ADAMW,
    OptimizerCost,
    QuantisedWeight,
    StateBytes,
    replicated_bytes,
)

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
Materialise = Callable[[nn.Module], None]


@dataclass(frozen=True)
class ShardingOptions:
    """The recipe's sharding options (`strategies.sharding_*`, `comm_hook`, `deepspeed_config`) and the
    plan facts a backend needs."""

    backend: str = "fsdp2"
    offload: str = "none"
    gradient_reduction: str = "auto"  # per_step | per_micro_step | auto (the backend's own)
    comm_hook: str = "none"
    deepspeed_config: str | None = None
    precision: str = "fp32"
    micro_batch_size: int = 1
    accumulation_steps: int = 1
    grad_clip: float | None = None


@dataclass(frozen=True)
class ShardingBackend:
    """One rank holds everything (`none`). Subclasses override what their layout changes."""

    name: str
    options: ShardingOptions = field(default_factory=ShardingOptions)
    shards_meta_models: ClassVar[bool] = False  # can wrap a meta-parameter model, then materialise shards
    checkpoint_format: ClassVar[str] = "replicated"  # what its `save` writes (sharded_checkpoint.FORMATS)
    reduces_over_context_ranks: ClassVar[bool] = False  # runs strategies.mesh.cp > 1 (context_parallel.py)
    shards_experts: ClassVar[bool] = False  # runs strategies.mesh.ep > 1 (expert_parallel.py)

    def check(self, env: DistEnv) -> None:
        if env.dp_size > 1:
            raise Unsupported(
                f"strategies.sharding: '{self.name}' cannot train on {env.dp_size} data-parallel ranks; "
                "set strategies.sharding=ddp"
            )
        self.check_replicated_options()

    def check_replicated_options(self) -> None:
        """none and ddp keep every state on the device: offload needs a ZeRO stage."""
        if self.options.offload != "none":
            raise Unsupported(
                f"strategies.sharding_offload: '{self.options.offload}' needs strategies.sharding=zero1/zero2/"
                f"zero3 ('{self.name}' keeps every state on the device); set strategies.sharding_offload=none"
            )
        self.check_reduction()

    def offloads(self) -> tuple[str, ...]:
        """The `sharding_offload` values this backend can run (none first)."""
        return ("none",)

    def reductions(self) -> tuple[str, ...]:
        """The `gradient_reduction` values this backend can run, its own behaviour first."""
        return ("per_step",)

    @property
    def gradient_reduction(self) -> str:
        """The reduction this backend runs (`auto`: its own)."""
        chosen = self.options.gradient_reduction
        return self.reductions()[0] if chosen == "auto" else chosen

    def check_reduction(self) -> None:
        chosen, possible = self.options.gradient_reduction, self.reductions()
        if chosen != "auto" and chosen not in possible:
            raise Unsupported(
                f"strategies.gradient_reduction: '{chosen}' is not what {self.name} on this backend does under "
                f"accumulation ({self._reduction_facts()}); set strategies.gradient_reduction="
                f"{' or '.join(possible)} or auto"
            )

    def _reduction_facts(self) -> str:
        return "its gradients are whole on every rank and reduced once, after the last micro-step"

    def prepare(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        env: DistEnv,
        make_optimizer: OptimizerFactory,
        materialise: Materialise | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap the model (already on its device) and build the optimizer on what this rank steps. A
        backend with `shards_meta_models` receives a meta-parameter model and calls `materialise` on it
        once sharded, before building the optimizer."""
        return model, make_optimizer(model)

    def grad_sync_scale(self, env: DistEnv) -> float:
        """Factor that undoes the backend's gradient averaging, so the loss is normalised globally."""
        return 1.0

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        """Context of one micro-step's forward and backward (no gradient sync but on the last)."""
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        """Back-propagate one micro-step's (already normalised) loss."""
        loss.backward()

    def engine_step(self, model: nn.Module) -> tuple[float, bool] | None:
        """For a backend whose engine clips and steps itself (DeepSpeed): do both and return (gradient
        norm before clipping, skipped). None: the trainer clips and steps the optimizer."""
        return None

    def discard_step(self, model: nn.Module) -> None:
        """Forget a step that failed mid-flight (out of memory) beyond the gradients the trainer zeroes:
        state the backend keeps between micro-steps. The trainer then redoes the step."""
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # ------------------------------------------------------------------ bytes
    def state_bytes(
        self,
        shape: ModelShape,
        world_size: int,
        optimizer: OptimizerCost = ADAMW,
        *,
        dim0: Mapping[str, int] | None = None,
        rank: int | None = None,
        quantised: Mapping[str, QuantisedWeight] | None = None,
    ) -> StateBytes:
        """Per-rank bytes of weights, gradients, optimizer states and backend buffers (`rank=None`:
        the most loaded rank); `dim0` maps parameter names to their leading dimension (FSDP2 padding);
        `quantised`: a QLoRA base's packed weights, read by the backends that shard one (FSDP2; the others
        refuse it, `Quantization.check_sharding`, or keep it whole: the planner's replicated arithmetic)."""
        return replicated_bytes(shape, self.options.precision, optimizer, ddp=False)

    def estimate(
        self,
        shape: ModelShape,
        footprint: Footprint,
        world_size: int,
        optimizer: OptimizerCost = ADAMW,
        *,
        dim0: Mapping[str, int] | None = None,
    ) -> Footprint:
        """`footprint` with the model-state components of the most loaded rank (pure arithmetic)."""
        return self.state_bytes(shape, world_size, optimizer, dim0=dim0).footprint(footprint)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_format_on(self, env: DistEnv) -> str:
        """What `save` writes on `env` (the checkpoint's manifest): `checkpoint_format`, except that tensor
        parallel's DTensor shards (tp > 1) go to DCP, since no rank holds a whole replicated state."""
        return "dcp" if env.shape.tp > 1 else self.checkpoint_format

    def save(self, staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        """Write model and optimizer state into `staging` (replicated states: rank 0 writes; tensor-parallel
        shards: every rank its own, in DCP, which a resume on another mesh reshards)."""
        if self.checkpoint_format_on(env) == "dcp":
            import memtrain.strategies.sharding.sharded_checkpoint as sharded_checkpoint

            sharded_checkpoint.save_sharded(staging, self.unwrap(model), optimizer)
        elif env.is_main:
            ckpt.save_tensor_file(staging / "model.pt", self.unwrap(model).state_dict())
            ckpt.save_tensor_file(staging / "optimizer.pt", optimizer.state_dict())

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        import memtrain.strategies.sharding.sharded_checkpoint as sharded_checkpoint

        if sharded_checkpoint.detect_format(path) != "replicated" or self.checkpoint_format_on(env) == "dcp":
            # DCP's shards, or (tensor parallel) a replicated checkpoint's whole tensors, into this rank's shards
            sharded_checkpoint.load_sharded(path, self.unwrap(model), optimizer)
            return
        state = ckpt.load_tensor_file(path / "model.pt")
        try:
            load_model_state(self.unwrap(model), state)
        except RuntimeError as exc:
            raise ckpt.CheckpointError(f"{path / 'model.pt'}: does not fit this model ({exc})") from None
        optimizer_file = path / "optimizer.pt"
        try:
            optimizer.load_state_dict(ckpt.load_tensor_file(optimizer_file))
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # e.g. another optimizer's state
            raise ckpt.CheckpointError(
                f"{optimizer_file}: does not fit this run ({type(exc).__name__}: {exc})"
            ) from None
        if not is_zero_redundancy(optimizer):  # zero1's states are this rank's share
            check_optimizer_shapes(optimizer, optimizer_file)


def is_zero_redundancy(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is torch's ZeroRedundancyOptimizer (zero1), without importing
    torch.distributed.optim (seconds: it imports FSDP and dynamo) where nothing has: then it is not one."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def check_optimizer_shapes(optimizer: torch.optim.Optimizer, file: Path) -> None:
    """Another model's optimizer.pt loads without complaint (same number of tensors) and would fail, or
    broadcast silently, in the first step: each state tensor must have its parameter's shape, or, for an
    optimizer that says its states are factored or projected (`factored_states`: Adafactor's (rows, 1) and
    (1, cols), GaLore's (rows, rank) and its projection), its number of dimensions with none larger than
    the parameter's."""
    fits = _fits if getattr(optimizer, "factored_states", False) else torch.Size.__eq__
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and not fits(value.shape, param.shape):
                    raise ckpt.CheckpointError(
                        f"{file}: optimizer state {name!r} has shape {tuple(value.shape)} for a parameter of "
                        f"shape {tuple(param.shape)} (written for another model)"
                    )


def _fits(state: torch.Size, param: torch.Size) -> bool:
    return state == param or (
        len(state) == len(param) and all(s <= p for s, p in zip(state, param, strict=True))
    )


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`model.load_state_dict(state)`, except for bitsandbytes-quantised frozen base weights (a QLoRA run's):
    bitsandbytes writes them with their quantisation state but cannot load them back into its layers. They
    never train, and setup rebuilt them from the same weights with the same quantisation, so they are
    already what the checkpoint holds; every other tensor must load, as usual."""
    quantised = {
        name for name, p in model.named_parameters() if not p.requires_grad and not p.is_floating_point()
    }
    skipped = {k for k in state if k in quantised or any(k.startswith(q + ".") for q in quantised)}
    skipped |= {
        k
        for k in state
        if k.endswith((".SCB", ".weight_format")) and k.rsplit(".", 1)[0] + ".weight" in quantised
    }
    if not skipped:
        model.load_state_dict(state)
        return
    result = model.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=False)
    missing = [k for k in result.missing_keys if k not in quantised and k not in skipped]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}")


def check_whole_parameters(name: str, env: DistEnv) -> None:
    """ddp and zero1 wrap parameters that are whole tensors, over every rank: no tensor-parallel shards."""
    if env.shape.tp > 1:
        raise Unsupported(
            f"strategies.sharding: {name} replicates whole parameters over every rank, which tensor parallelism "
            f"(strategies.mesh.tp={env.shape.tp}) splits; set strategies.sharding=zero2 or zero3 (FSDP2 shards "
            "the tensor-parallel pieces), or none with strategies.mesh.dp_shard=1"
        )


@dataclass(frozen=True)
class DDPBackend(ShardingBackend):
    def check(self, env: DistEnv) -> None:
        check_whole_parameters(self.name, env)
        self.check_replicated_options()

    def prepare(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        env: DistEnv,
        make_optimizer: OptimizerFactory,
        materialise: Materialise | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        optimizer = make_optimizer(model)
        if not env.distributed:
            return model, optimizer
        return ddp_hooks.wrap_ddp(model, env, self.options.comm_hook), optimizer

    def state_bytes(
        self,
        shape: ModelShape,
        world_size: int,
        optimizer: OptimizerCost = ADAMW,
        *,
        dim0: Mapping[str, int] | None = None,
        rank: int | None = None,
        quantised: Mapping[str, QuantisedWeight] | None = None,
    ) -> StateBytes:
        return replicated_bytes(shape, self.options.precision, optimizer, ddp=world_size > 1)

    def grad_sync_scale(self, env: DistEnv) -> float:
        return float(env.dp_size)

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DistributedDataParallel) and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    def discard_step(self, model: nn.Module) -> None:
        """DDP broadcasts its buffers in the first forward after a synchronised one, and notes in each
        forward's epilogue whether the next must. A forward cut short by the OOM skipped that epilogue
        on one rank only, so the ranks would disagree about broadcasting in the redone step's first
        forward (a collective one rank never joins: a hang). Every rank broadcasts there instead."""
        if isinstance(model, DistributedDataParallel):
            model.require_forward_param_sync = True

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model


def warn_one_rank(name: str) -> None:
    """A ZeRO stage on one rank shards nothing; it still runs (same numerics as on several ranks)."""
    warnings.warn(
        f"strategies.sharding: {name} on one rank shards nothing (every state stays whole on this rank); "
        "running it anyway",
        stacklevel=3,
    )


def ensure_process_group(env: DistEnv) -> None:
    """FSDP2 and DeepSpeed need a process group even on one rank: a one-rank group on an in-memory
    store (no address, no port) when the run was not launched by torchrun."""
    if not dist.is_initialized():
        backend = "nccl" if env.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
