"""Sharding strategies: how the model and its states are laid out over the data-parallel ranks.

Each strategy is a recipe name (`strategies.sharding`) with the recipe's sharding options as its fields
(`sharding_backend`, `sharding_offload`, `gradient_reduction`, `comm_hook`, `deepspeed_config`). It builds
the backend that does the work (`base.ShardingBackend`: none/ddp here, FSDP2, ZeroRedundancyOptimizer,
DeepSpeed in their own modules, imported when a plan first uses them: `zero_backend`) once the plan's
facts the backend needs are known: precision, micro-batching and clipping.

Two options may be left to the planner: `sharding_offload` (`auto` or a list) and `gradient_reduction`
(`auto`). `choices()` turns such a strategy into the concrete ones its backend can run; a plan holds only
concrete ones (a pinned plan's `gradient_reduction: auto` is the backend's own behaviour).

Facts the planner reads: `replicated` (every rank holds every state, so a trace's gradients are this
rank's), `multi_rank` (offered by `auto` on several ranks), `hands_bf16_weights(precision)` (the
forward reads bf16 weights the backend gathered, instead of autocasting fp32 ones) and `as_stored(precision)`
(whether frozen parameters keep the precision's `frozen_dtype`).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.strategies.precision import Precision
from memtrain.strategies.registry import RecipeKey, Registry, Strategy, option
from memtrain.strategies.sharding.base import DDPBackend, ShardingBackend, ShardingOptions

OffloadName = Literal["none", "optimizer", "params"]
OffloadChoice = Literal["none", "optimizer", "params", "auto"] | list[OffloadName]
"""`strategies.sharding_offload`: one offload, `auto` (each one the backend supports) or a list of them."""


@dataclass(frozen=True)
class Sharding(Strategy):
    """`none`: one rank holds everything."""

    kind: ClassVar[str] = "sharding"
    name: ClassVar[str] = "none"
    replicated: ClassVar[bool] = True
    multi_rank: ClassVar[bool] = False
    gradient_sync: ClassVar[str] = "none"  # "all-reduce" | "reduce-scatter" | "none", per step
    parameter_gathers: ClassVar[tuple[int, int]] = (
        0,
        0,
    )  # all-gathers of the weights per step, per micro-step
    backend: str = option(
        "fsdp2",
        recipe_key="sharding_backend",
        recipe_type=Literal["fsdp2", "deepspeed"],
        doc="Backend of zero1/zero2/zero3: fsdp2 (zero1: ZeroRedundancyOptimizer) or deepspeed.",
        changes_trajectory=False,
    )
    offload: str | list[str] = option(  # auto, a list: the planner's
        "none",
        recipe_key="sharding_offload",
        recipe_type=OffloadChoice,
        doc="ZeRO offload to host memory: optimizer states (deepspeed) or params (fsdp2 zero2/zero3, "
        "deepspeed zero3); auto or a list: the planner offers each the backend supports, on a GPU (also on "
        "one rank, with sharding auto), priced by the host link and the host's optimizer step.",
        changes_trajectory=False,
    )
    gradient_reduction: str = option(
        "auto",
        recipe_key="gradient_reduction",
        recipe_type=Literal["auto", "per_step", "per_micro_step"],
        doc="When zero2/zero3 reduce gradients under accumulation: per_step (fsdp2: an unsharded fp32 "
        "gradient accumulates until the last micro-step, one reduce-scatter) or per_micro_step (a "
        "reduce-scatter every micro-step, gradients stay sharded; what deepspeed zero2/zero3 always do). "
        "auto: the planner chooses; a plan that pins every choice takes the backend's own (fsdp2: per_step).",
        changes_trajectory=False,
    )
    comm_hook: str = option(
        "none",
        recipe_key="comm_hook",
        recipe_type=Literal["none", "bf16", "powersgd"],
        doc="DDP gradient-communication hook (ddp, zero1 on fsdp2).",
        changes_trajectory=True,
    )
    deepspeed_config: str | None = option(
        None,
        recipe_key="deepspeed_config",
        doc="DeepSpeed JSON merged into the generated config; keys contradicting the recipe are errors.",
        changes_trajectory=True,
    )

    def build(
        self,
        precision: Precision | str = "fp32",
        micro_batch_size: int = 1,
        accumulation_steps: int = 1,
        grad_clip: float | None = None,
    ) -> ShardingBackend:
        """The backend for this layout, with the plan's facts it needs."""
        options = ShardingOptions(
            backend=self.backend,
            offload=self.offload if isinstance(self.offload, str) else "auto",
            gradient_reduction=self.gradient_reduction,
            comm_hook=self.comm_hook,
            deepspeed_config=self.deepspeed_config,
            precision=_name(precision),
            micro_batch_size=micro_batch_size,
            accumulation_steps=accumulation_steps,
            grad_clip=grad_clip,
        )
        return self.backend_class()(self.name, options)

    def backend_class(self) -> type[ShardingBackend]:
        return ShardingBackend

    def check_with(self, env: DistEnv, precision: Precision | str) -> None:
        """`Unsupported` when this layout cannot run on `env` with `precision` (the backend's checks)."""
        if self.offload_is_open:
            raise Unsupported(
                f"strategies.sharding_offload: {self.offload!r} asks the planner to choose, but the recipe pins "
                "every other choice, so the planner does not run; pin one value (none, optimizer, params) or "
                "leave another choice open (e.g. batch.micro_size: auto)"
            )
        backend = self.build(precision)
        if env.shape.cp > 1 and not backend.reduces_over_context_ranks:
            raise Unsupported(
                f"strategies.sharding: '{self.name}' does not reduce gradients over the context-parallel ranks "
                f"(strategies.mesh.cp={env.shape.cp}: each holds other tokens of the same rows); set "
                "strategies.sharding=zero2 or zero3 with strategies.sharding_backend=fsdp2"
            )
        if env.shape.ep > 1 and not backend.shards_experts:
            raise Unsupported(
                f"strategies.sharding: '{self.name}' cannot shard experts split over expert-parallel ranks "
                f"(strategies.mesh.ep={env.shape.ep}); set strategies.sharding=zero2 or zero3 with "
                "strategies.sharding_backend=fsdp2"
            )
        backend.check(env)

    @property
    def offload_is_open(self) -> bool:
        """`sharding_offload` is `auto` or a list: the planner's to choose."""
        return not isinstance(self.offload, str) or self.offload == "auto"

    def choices(self) -> list[Sharding]:
        """The concrete strategies this one allows: each offload of the list (`auto`: each one the backend
        supports) with each reduction the backend can run when `gradient_reduction` is `auto`. A listed
        offload the backend cannot run stays in (its check says why)."""
        backend = dataclasses.replace(self, offload="none").build()
        offloads = (
            backend.offloads()
            if self.offload == "auto"
            else [self.offload]
            if isinstance(self.offload, str)
            else list(dict.fromkeys(self.offload))
        )
        reductions = backend.reductions() if self.gradient_reduction == "auto" else (self.gradient_reduction,)
        return [
            dataclasses.replace(self, offload=o, gradient_reduction=r) for o in offloads for r in reductions
        ]

    def own_reduction(self) -> str:
        """The backend's own `gradient_reduction` (what `auto` runs when the planner does not choose)."""
        return self.build().reductions()[0]

    def reductions_per_step(self, micro_steps: int) -> int:
        """Gradient reductions (all-reduce or reduce-scatter) per optimizer step over `micro_steps`."""
        return micro_steps if self.build().gradient_reduction == "per_micro_step" else 1

    def describe(self) -> str:
        """`Strategy.describe` without the reduction when it is the backend's own (the usual case)."""
        own = self.gradient_reduction == self.own_reduction()
        return Strategy.describe(dataclasses.replace(self, gradient_reduction="auto") if own else self)

    def hands_bf16_weights(self, precision: Precision) -> bool:
        return False

    @classmethod
    def as_stored(cls, precision: Precision) -> Precision:
        """`precision` as this layout stores the weights: frozen parameters in the compute dtype
        (`frozen_dtype: compute`) where every rank keeps the model as built (none, ddp); the sharded
        layouts' backends lay frozen weights out with the rest, at the precision's stored dtype, as their
        per-rank arithmetic counts them."""
        if cls.replicated or precision.frozen_dtype == "fp32":
            return precision
        return dataclasses.replace(precision, frozen_dtype="fp32")


SHARDING: Registry[Sharding] = Registry(
    "sharding",
    Sharding,
    RecipeKey(
        "strategies",
        "sharding",
        "none",
        "How model states are spread over the ranks: none, ddp, zero1, zero2 or zero3.",
        changes_trajectory=False,
    ),
)
SHARDING.register(Sharding)


@SHARDING.register
@dataclass(frozen=True)
class DDP(Sharding):
    """A full replica per rank; gradients all-reduced after the last micro-step."""

    name: ClassVar[str] = "ddp"
    multi_rank: ClassVar[bool] = True
    gradient_sync: ClassVar[str] = "all-reduce"

    def backend_class(self) -> type[ShardingBackend]:
        return DDPBackend


@dataclass(frozen=True)
class _Zero(Sharding):
    replicated: ClassVar[bool] = False
    multi_rank: ClassVar[bool] = True

    def backend_class(self) -> type[ShardingBackend]:
        if self.backend == "deepspeed":
            return zero_backend("deepspeed_backend", "DeepSpeedBackend")
        return zero_backend("fsdp2", "FSDP2Backend")

    def hands_bf16_weights(self, precision: Precision) -> bool:
        """bf16-mixed on FSDP2's zero2/zero3 mixed-precision policy, or on any DeepSpeed stage's bf16 mode."""
        return precision.name == "bf16-mixed"


@SHARDING.register
@dataclass(frozen=True)
class Zero1(_Zero):
    """Optimizer states sharded (FSDP2 backend: ZeroRedundancyOptimizer over DDP)."""

    name: ClassVar[str] = "zero1"
    gradient_sync: ClassVar[str] = "all-reduce"
    parameter_gathers: ClassVar[tuple[int, int]] = (1, 0)  # the updated shards, once per step

    def backend_class(self) -> type[ShardingBackend]:
        if self.backend == "deepspeed":
            return zero_backend("deepspeed_backend", "DeepSpeedBackend")
        return zero_backend("zero1", "Zero1Backend")

    def hands_bf16_weights(self, precision: Precision) -> bool:
        return self.backend == "deepspeed" and super().hands_bf16_weights(precision)


@SHARDING.register
@dataclass(frozen=True)
class Zero2(_Zero):
    """Optimizer states and gradients sharded."""

    name: ClassVar[str] = "zero2"
    gradient_sync: ClassVar[str] = "reduce-scatter"
    parameter_gathers: ClassVar[tuple[int, int]] = (0, 1)


@SHARDING.register
@dataclass(frozen=True)
class Zero3(_Zero):
    """Optimizer states, gradients and parameters sharded."""

    name: ClassVar[str] = "zero3"
    gradient_sync: ClassVar[str] = "reduce-scatter"
    parameter_gathers: ClassVar[tuple[int, int]] = (0, 2)  # forward, and again for backward


def zero_backend(module: str, name: str) -> type[ShardingBackend]:
    """The ZeRO backend class `name` of this package's `module`, imported when a plan first asks for it:
    the FSDP2, ZeroRedundancyOptimizer and DeepSpeed modules import torch.distributed.fsdp, .optim and
    .checkpoint (seconds), which `memtrain validate`, `--help` and a one-rank plan never use."""
    backend: type[ShardingBackend] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return backend


def make_sharding(name: str, **options: Any) -> ShardingBackend:
    """The backend of sharding `name` built from `ShardingOptions` fields (tests and measurements)."""
    layout = {
        k: options.pop(k)
        for k in ("backend", "offload", "gradient_reduction", "comm_hook", "deepspeed_config")
        if k in options
    }
    return SHARDING.get(name)(**layout).build(
        options.pop("precision", "fp32"),
        options.pop("micro_batch_size", 1),
        options.pop("accumulation_steps", 1),
        options.pop("grad_clip", None),
    )


def _name(precision: Precision | str) -> str:
    return precision if isinstance(precision, str) else precision.name
