"""Which optimizer trains (`optimizer.name`), and how many state bytes each keeps: a planned choice.

Why a kind of its own: the optimizer-state bytes per parameter are one of the four components memtrain
plans, and the optimizers differ in them far more than AdamW's storage formats do. But changing the
optimizer changes the training, so the planner chooses only among the optimizers a recipe lists
(`optimizer.name: [adamw, adafactor]`); the default is the single choice `adamw`, and `auto` is refused.

- `adamw`: `torch.optim.AdamW`, its moments stored as `strategies.optimizer_states` says (fp32, bf16,
  8bit, paged-8bit, 4bit): 8 bytes per fp32 parameter, plus a 4-byte `step` per tensor.
- `adafactor`: `torch.optim.Adafactor` (torch >= 2.5): the second moment factored into a row and a column
  vector per matrix (a full vector for a 1-D tensor), no first moment, a 4-byte `step` per tensor.
  `train.lr` is its (relative) learning rate; `train.betas` and `train.eps` are not read.
- `lion`: `memtrain.strategies.lion.Lion`: one momentum per parameter (4 bytes per fp32 parameter), no step.
- `galore`: GaLore's AdamW (galore-torch, `memtrain.strategies.galore`): every matrix's gradient projected
  to `optimizer.galore_rank` dimensions on its smaller side, Adam's two moments kept in the projected
  space plus the projection (rank x side), re-projected every `optimizer.galore_update_proj_gap` steps.

Each non-AdamW optimizer's facts live in an `OptimizerStates` of its own (not registered: the recipe's
`strategies.optimizer_states` stays AdamW's storage format), so the planner, the sharding arithmetic
(`OptimizerCost`) and the step-time model read them exactly as they read AdamW's (`Plan.update_states`).
Where one cannot run, `check_with` names the keys: the other optimizers keep their own state format
(`strategies.optimizer_states` other than fp32 is AdamW's), DeepSpeed wraps its client optimizer over one
flat fp32 partition (no matrix left to factor or project, and it runs only Adam-family optimizers
untested), and FSDP2's zero2/zero3 shard every matrix by rows, which Adafactor's column statistics and
GaLore's projection need whole.

The state bytes are exact (tests/strategies/test_optimizers.py, against the tracker); the step's
temporaries (`per_tensor_temporaries`, ...) and `relative_step_cost` of these states are read off their
update rules, not measured as AdamW's are.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch
from torch.optim.optimizer import ParamsT

from memtrain.errors import Unsupported
from memtrain.memory.footprint import ModelShape, ParamInfo
from memtrain.strategies.lion import Lion
from memtrain.strategies.optimizer import STEP_TENSOR_BYTES, OptimizerStates
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy, option
from memtrain.strategies.sharding import Sharding


@dataclass(frozen=True)
class Optimizer(Strategy):
    """`adamw`: the update rule of `strategies.optimizer_states` (AdamW in every storage format).

    `states(stored)` is what the step keeps, with the facts the planner reads; `whole_matrices`: the states
    need every matrix unsharded (no FSDP2 zero2/zero3); `steps_in_backward`: one parameter group fits all
    (what `optimizer_step: in_backward` checkpoints)."""

    kind: ClassVar[str] = "optimizer"
    name: ClassVar[str] = "adamw"
    whole_matrices: ClassVar[bool] = False
    steps_in_backward: ClassVar[bool] = True

    def states(self, stored: OptimizerStates) -> OptimizerStates:
        return stored

    def check_with(self, stored: OptimizerStates, sharding: Sharding, in_backward: bool = False) -> None:
        """`Unsupported`, naming the keys, when this optimizer cannot run with these choices."""
        if in_backward and not self.steps_in_backward:
            raise Unsupported(
                f"strategies.optimizer_step: in_backward saves one parameter group for every parameter; "
                f"optimizer.name {self.name} keeps two (matrices projected, vectors not): use "
                "strategies.optimizer_step=standard or another optimizer.name"
            )
        if stored.name == "4bit" and sharding.name not in ("none", "ddp"):
            raise Unsupported(
                f"strategies.optimizer_states: 4bit states are tensor subclasses that strategies.sharding="
                f"{sharding.name} cannot partition or checkpoint; use sharding none or ddp, or optimizer_states 8bit"
            )
        if self.name == "adamw":
            return
        if stored.name != "fp32":
            raise Unsupported(
                f"strategies.optimizer_states: {stored.name} stores AdamW's moments; optimizer.name {self.name} "
                "keeps its own states: use strategies.optimizer_states=fp32 or optimizer.name=adamw"
            )
        if sharding.name.startswith("zero") and sharding.backend == "deepspeed":
            raise Unsupported(
                f"optimizer.name: {self.name} cannot run on DeepSpeed, which steps its client optimizer over one "
                "flat fp32 partition; use strategies.sharding_backend=fsdp2 or optimizer.name=adamw"
            )
        if self.whole_matrices and sharding.name in ("zero2", "zero3"):
            raise Unsupported(
                f"optimizer.name: {self.name} needs each matrix whole, which strategies.sharding={sharding.name} "
                "shards by rows; use strategies.sharding none, ddp or zero1, or optimizer.name=adamw"
            )

    def build(
        self,
        params: ParamsT,
        stored: OptimizerStates,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> torch.optim.Optimizer:
        return self.states(stored).build(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


OPTIMIZERS: Registry[Optimizer] = Registry(
    "optimizer",
    Optimizer,
    RecipeKey(
        "optimizer",
        "name",
        "adamw",
        "The optimizer: adamw, adafactor, lion or galore; a list lets the planner choose among them "
        "(it changes the training, so never auto).",
        changes_trajectory=True,
    ),
)
OPTIMIZERS.register(Optimizer)


@dataclass(frozen=True)
class AdafactorStates(OptimizerStates):
    """`torch.optim.Adafactor`: a row and a column second-moment vector per matrix, a `step` per tensor."""

    name: ClassVar[str] = "adafactor"
    shape_dependent: ClassVar[bool] = True
    per_tensor_temporaries: ClassVar[int] = 3
    per_tensor_carried: ClassVar[int] = 1
    foreach_temporaries: ClassVar[int | None] = 3
    fused_temporaries: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = STEP_TENSOR_BYTES
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.0, "cpu": 1.0}

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        return FactoredAdafactor(params, lr=lr, weight_decay=weight_decay)

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        factored = sum(_adafactor_elements(p) for p in shape.params)
        return factored * param_bytes + STEP_TENSOR_BYTES * len(shape.params)


class FactoredAdafactor(torch.optim.Adafactor):
    """torch's Adafactor, saying its second moment is factored (a row and a column state per matrix, not the
    parameter's shape): what a resume's shape check of its optimizer.pt allows."""

    factored_states: ClassVar[bool] = True


def _adafactor_elements(p: ParamInfo) -> int:
    """Rows (the last dimension reduced) plus columns (the one before reduced), or the whole vector."""
    if len(p.dims) < 2:
        return p.numel
    return p.numel // p.dims[-1] + p.numel // p.dims[-2]


@dataclass(frozen=True)
class LionStates(OptimizerStates):
    """`Lion`: one momentum in the parameter dtype, no step counter."""

    name: ClassVar[str] = "lion"
    per_tensor_temporaries: ClassVar[int] = 1
    per_tensor_carried: ClassVar[int] = 0
    foreach_temporaries: ClassVar[int | None] = None
    fused_temporaries: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = 0
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 0.8, "cpu": 0.8}

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        return shape.numel * param_bytes


@dataclass(frozen=True)
class GaLoreStates(OptimizerStates):
    """GaLore's AdamW: per matrix (m, n) and r = min(rank, m, n), the moments of the projected gradient
    (2 x r x max(m, n)) and the projection (r x min(m, n)); AdamW's two moments for the other tensors."""

    name: ClassVar[str] = "galore"
    shape_dependent: ClassVar[bool] = True
    per_tensor_temporaries: ClassVar[int] = 4
    per_tensor_carried: ClassVar[int] = 1
    foreach_temporaries: ClassVar[int | None] = None
    fused_temporaries: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = 0
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 2.0, "cpu": 2.0}
    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        galore = _galore_module()
        groups = galore.galore_groups(params, self.rank, self.update_proj_gap, self.scale)
        optimizer: torch.optim.Optimizer = galore.TrackedGaLoreAdamW(
            groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        return optimizer

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        return sum(self._elements(p) for p in shape.params) * param_bytes

    def _elements(self, p: ParamInfo) -> int:
        if len(p.dims) != 2:
            return 2 * p.numel
        rows, cols = p.dims
        r = min(self.rank, rows, cols)
        if rows >= cols:  # the gradient times the projection's transpose: (rows, r); projection (r, cols)
            return 2 * rows * r + r * cols
        return 2 * r * cols + rows * r  # the projection's transpose times the gradient: (r, cols)


def _galore_module() -> ModuleType:
    try:
        return importlib.import_module("memtrain.strategies.galore")
    except ImportError as exc:
        raise Unsupported(
            f"optimizer.name: galore needs galore-torch, which cannot be imported ({exc}); "
            "pip install 'memtrain[galore]', or use another optimizer.name"
        ) from None


@OPTIMIZERS.register
@dataclass(frozen=True)
class AdafactorOptimizer(Optimizer):
    """`adafactor`: factored second moments (torch.optim.Adafactor)."""

    name: ClassVar[str] = "adafactor"
    whole_matrices: ClassVar[bool] = True

    def states(self, stored: OptimizerStates) -> OptimizerStates:
        return AdafactorStates()


@OPTIMIZERS.register
@dataclass(frozen=True)
class LionOptimizer(Optimizer):
    """`lion`: sign updates from one momentum."""

    name: ClassVar[str] = "lion"

    def states(self, stored: OptimizerStates) -> OptimizerStates:
        return LionStates()


@OPTIMIZERS.register
@dataclass(frozen=True)
class GaLoreOptimizer(Optimizer):
    """`galore`: AdamW on low-rank projections of every matrix's gradient (galore-torch)."""

    name: ClassVar[str] = "galore"
    whole_matrices: ClassVar[bool] = True
    steps_in_backward: ClassVar[bool] = False
    rank: int = option(
        128, recipe_key="galore_rank", doc="galore: the projection's rank.", changes_trajectory=True, gt=0
    )
    update_proj_gap: int = option(
        200,
        recipe_key="galore_update_proj_gap",
        doc="galore: steps between two projections (an SVD of each matrix's gradient).",
        changes_trajectory=True,
        gt=0,
    )
    scale: float = option(
        0.25,
        recipe_key="galore_scale",
        doc="galore: the projected update's scale.",
        changes_trajectory=True,
        gt=0,
    )

    def check(self, facts: DeviceFacts) -> None:
        _galore_module()

    def states(self, stored: OptimizerStates) -> OptimizerStates:
        return GaLoreStates(rank=self.rank, update_proj_gap=self.update_proj_gap, scale=self.scale)
