"""zero1 / zero2 / zero3 on DeepSpeed (`strategies.sharding_backend=deepspeed`).

Why a second backend: DeepSpeed offloads the optimizer alone (ZeRO-Offload) and partitions ZeRO-1/2
states inside flat buffers, which FSDP2 does not, and many teams already run it. Its engine owns
backward (loss scaling, gradient partitioning hooks) and the step (clipping, master-weight update),
so the trainer reaches it through three hooks and stays one loop:

- `micro_step`: `set_gradient_accumulation_boundary(last)`: the trainer owns accumulation
  (deepspeed_config.py); DeepSpeed reduces stage-1 gradients at the boundary and stage-2/3 gradients
  into their partitions every micro-step, as it always does (its engine's `allreduce_gradients`), so
  `gradient_reduction` is `per_step` for zero1 and `per_micro_step` for zero2/zero3, and the other
  is refused;
- `backward`: `engine.backward(loss, scale_wrt_gas=False)`: the loss is already normalised by the
  global token count, so DeepSpeed must not divide it by the accumulation steps again; its averaging
  over ranks is undone by `grad_sync_scale` as for DDP;
- `engine_step`: `engine.step()` clips (config `gradient_clipping`) and steps; the reported norm is
  DeepSpeed's global norm before clipping.

Precision: `bf16-mixed` is DeepSpeed's bf16 mode (bf16 model parameters, fp32 master partitions in
the optimizer); the trainer's autocast stays on. fp16-mixed is refused (DeepSpeed's loss scaler and
the trainer's GradScaler would both scale), bf16-master and bf16-true are refused (DeepSpeed's bf16
already keeps fp32 masters), fp8 is refused.

Checkpoints: DeepSpeed's own `save_checkpoint` / `load_checkpoint` into `<staging>/deepspeed/`, plus a
small `sharding.json` (world size, stage): DeepSpeed partitions do not reshard, so a different world
size is refused with the way out. DeepSpeed would load its own files with full pickle
(`weights_only=False`); on resume the engine reads them through `safe_readers.deepspeed_reads_safely`
(`weights_only=True` and the few DeepSpeed classes its files hold).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

import memtrain.strategies.sharding.deepspeed_config as dsc
import memtrain.strategies.sharding.sharded_checkpoint as sharded_checkpoint
from memtrain import checkpoint as ckpt
from memtrain import jsonfile
from memtrain.distributed import DistEnv
from memtrain.errors import MemtrainError, Unsupported
from memtrain.memory.footprint import ModelShape
from memtrain.strategies.sharding import safe_readers
from memtrain.strategies.sharding.base import (
    Materialise,
    OptimizerFactory,
    ShardingBackend,
    ensure_process_group,
    warn_one_rank,
)
from memtrain.strategies.sharding.state_bytes import (
    ADAMW,
    DeepSpeedZero3Knobs,
    OptimizerCost,
    QuantisedWeight,
    StateBytes,
    deepspeed_bytes,
)

TAG = "state"
SHARDING_JSON_BYTES = 4096  # {"world_size": .., "stage": ..}
REFUSED_PRECISIONS = {
    "fp16-mixed": "DeepSpeed's fp16 loss scaler and memtrain's GradScaler would both scale; use bf16-mixed",
    "bf16-master": "DeepSpeed's bf16 mode already keeps fp32 master weights; use bf16-mixed",
    "bf16-true": "DeepSpeed's bf16 mode keeps fp32 master weights (that is bf16-mixed here); use bf16-mixed, "
    "or strategies.sharding_backend=fsdp2",
    "fp8": "fp8 is not wired into DeepSpeed here; use bf16-mixed or strategies.sharding_backend=fsdp2",
}


@dataclass(frozen=True)
class DeepSpeedBackend(ShardingBackend):
    checkpoint_format: ClassVar[str] = "deepspeed"

    @property
    def stage(self) -> int:
        return int(self.name[-1])

    def offloads(self) -> tuple[str, ...]:
        return ("none", "optimizer", "params") if self.stage == 3 else ("none", "optimizer")

    def reductions(self) -> tuple[str, ...]:
        return ("per_step",) if self.stage == 1 else ("per_micro_step",)

    def _reduction_facts(self) -> str:
        if self.stage == 1:
            return "DeepSpeed ZeRO-1 keeps whole gradients and reduces them at the accumulation boundary"
        return f"DeepSpeed ZeRO-{self.stage} reduces into its gradient partitions on every micro-step"

    def check(self, env: DistEnv) -> None:
        self.check_reduction()
        if not env.shape.is_flat:
            raise Unsupported(
                f"strategies.mesh: DeepSpeed runs here on one data-parallel dimension only (its hierarchical "
                f"partitioning, hpZ/MiCS, is not wired to a mesh), not {env.shape.describe()}; set "
                "strategies.sharding_backend=fsdp2, or strategies.mesh to dp_shard only"
            )
        if importlib.util.find_spec("deepspeed") is None:
            raise Unsupported(
                "strategies.sharding_backend: deepspeed is not installed; pip install 'memtrain[deepspeed]' "
                "or set strategies.sharding_backend=fsdp2"
            )
        if self.options.offload == "params" and self.stage != 3:
            raise Unsupported(
                f"strategies.sharding_offload: DeepSpeed offloads parameters only with zero3 (got {self.name}); "
                "set strategies.sharding_offload=optimizer or strategies.sharding=zero3"
            )
        if self.options.comm_hook != "none":
            raise Unsupported(
                f"strategies.comm_hook: '{self.options.comm_hook}' is a DDP hook (ddp, zero1 on fsdp2); set "
                "strategies.comm_hook=none (DeepSpeed's communication_data_type goes in strategies.deepspeed_config)"
            )
        reason = REFUSED_PRECISIONS.get(self.options.precision)
        if reason is not None:
            raise Unsupported(f"strategies.precision: {self.options.precision} on DeepSpeed: {reason}")
        if self.options.deepspeed_config is not None:
            dsc.read_user_config(self.options.deepspeed_config)

    def config(self, model_numel: int, world_size: int) -> dict[str, Any]:
        """The DeepSpeed config this backend runs with (generated from the plan, user JSON merged)."""
        plan = dsc.DeepSpeedPlan(
            stage=self.stage,
            precision=self.options.precision,
            offload=self.options.offload,
            micro_batch_size=self.options.micro_batch_size,
            accumulation_steps=self.options.accumulation_steps,
            world_size=world_size,
            grad_clip=self.options.grad_clip,
            model_numel=model_numel,
        )
        user = dsc.read_user_config(self.options.deepspeed_config) if self.options.deepspeed_config else None
        return dsc.build_config(plan, user)

    def prepare(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        env: DistEnv,
        make_optimizer: OptimizerFactory,
        materialise: Materialise | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed

        if not env.distributed:
            warn_one_rank(self.name)
            # DeepSpeed asserts that a launcher set LOCAL_RANK; a process started without one is rank 0.
            os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
        ensure_process_group(env)
        config = self.config(sum(p.numel() for p in model.parameters()), env.world_size)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=config
        )
        return engine, optimizer

    def grad_sync_scale(self, env: DistEnv) -> float:
        return float(env.world_size)

    @contextlib.contextmanager
    def _boundary(self, model: nn.Module, last: bool) -> Iterator[None]:
        model.set_gradient_accumulation_boundary(last)  # type: ignore[operator]
        yield

    def micro_step(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[None]:
        return self._boundary(model, last)

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        model.backward(loss, scale_wrt_gas=False)  # type: ignore[operator]

    def engine_step(self, model: nn.Module) -> tuple[float, bool]:
        skipped_before = int(model.skipped_steps)  # type: ignore[arg-type]
        model.step()  # type: ignore[operator]
        norm = model.get_global_grad_norm()  # type: ignore[operator]
        value = float(norm) if norm is not None else math.nan
        return value, int(model.skipped_steps) > skipped_before or not math.isfinite(value)  # type: ignore[arg-type]

    def discard_step(self, model: nn.Module) -> None:
        raise MemtrainError(
            "out of memory inside a DeepSpeed step: its partially reduced gradient partitions cannot be "
            "discarded, so the step cannot be redone; lower batch.micro_size or use strategies.sharding_backend=fsdp2"
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        inner = getattr(model, "module", model)
        assert isinstance(inner, nn.Module)
        return inner

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
        zero = self.config(shape.numel, world_size)["zero_optimization"]
        default = DeepSpeedZero3Knobs()
        knobs = DeepSpeedZero3Knobs(
            persistence_threshold=int(
                zero.get("stage3_param_persistence_threshold", default.persistence_threshold)
            ),
            max_reuse_distance=int(zero.get("stage3_max_reuse_distance", default.max_reuse_distance)),
            prefetch_bucket=int(zero.get("stage3_prefetch_bucket_size", default.prefetch_bucket)),
        )
        return deepspeed_bytes(
            shape,
            world_size,
            self.options.precision,
            optimizer,
            stage=self.stage,
            offload=self.options.offload,
            knobs=knobs,
            rank=rank,
        )

    # ------------------------------------------------------------------ checkpoints
    def save(self, staging: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        target = staging / sharded_checkpoint.DEEPSPEED_DIR
        model.save_checkpoint(str(target), tag=TAG, client_state={}, save_latest=False)  # type: ignore[operator]
        if env.is_main:
            meta = json.dumps({"world_size": env.world_size, "stage": self.stage}).encode()
            ckpt.write_file(target / "sharding.json", lambda handle: handle.write(meta))

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> None:
        found = sharded_checkpoint.detect_format(path)
        if found != "deepspeed":
            raise ckpt.CheckpointError(
                f"{path}: written in the {found} format (none, ddp or fsdp2 backends); DeepSpeed resumes only its "
                "own checkpoints: resume with strategies.sharding_backend=fsdp2"
            )
        source = path / sharded_checkpoint.DEEPSPEED_DIR
        saved = _sharding_record(source / "sharding.json")
        if saved["world_size"] != env.world_size or saved["stage"] != self.stage:
            raise ckpt.CheckpointError(
                f"{source}: saved by zero{saved['stage']} on {saved['world_size']} ranks; DeepSpeed partitions do not "
                f"reshard: resume with zero{saved['stage']} on {saved['world_size']} ranks (or convert it with "
                "DeepSpeed's zero_to_fp32.py and start from those weights)"
            )
        safe_readers.only_regular_files(source, "DeepSpeed")
        with safe_readers.deepspeed_reads_safely(model):
            loaded, _ = model.load_checkpoint(  # type: ignore[operator]
                str(source), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if loaded is None:
            raise ckpt.CheckpointError(f"{source}: DeepSpeed found no checkpoint to load")


def _sharding_record(file: Path) -> dict[str, int]:
    """sharding.json (world size and stage), read bounded and never blocking; CheckpointError naming it."""
    try:
        saved = jsonfile.parse_json(jsonfile.read_regular_file(file, SHARDING_JSON_BYTES))
    except (OSError, jsonfile.FileRefused) as exc:
        raise ckpt.CheckpointError(f"{file}: unreadable ({exc})") from None
    if not isinstance(saved, dict) or not all(type(saved.get(k)) is int for k in ("world_size", "stage")):
        raise ckpt.CheckpointError(f"{file}: damaged (world_size and stage must be integers)")
    return saved
