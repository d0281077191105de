"""Numerical precision of the forward/backward pass and of the stored weights.

| name        | weights / grads (B/param) | master copy | compute                                             |
|-------------|---------------------------|-------------|-----------------------------------------------------|
| fp32        | 4 / 4                     | -           | fp32                                                |
| bf16-mixed  | 4 / 4                     | -           | bf16 autocast                                       |
| bf16-master | 2 / 2                     | 4 (fp32, kept by the optimizer) | bf16                            |
| bf16-true   | 2 / 2                     | - (updates stochastically rounded) | bf16                         |
| fp16-mixed  | 4 / 4                     | -           | fp16 autocast, dynamic loss scaling (GradScaler)    |
| fp8         | 4 / 4                     | -           | torchao float8 for the blocks' linears, bf16 elsewhere |

bf16-true (Lightning's name; torchtune trains so by default) keeps no fp32 copy at all: AdamW's moments
are bf16 too (2 + 2 + 4 = 8 bytes per parameter instead of bf16-master's 12 and fp32's 16). What the fp32
master copy does for bf16-master, stochastic rounding of the parameter write does here (`update_states`:
`StochasticBF16AdamW`), so updates below bf16's resolution move the weights on average instead of being
lost. It trains with AdamW only, its moments in bf16 (`optimizer_states` fp32 or bf16, the same bytes
over bf16 parameters), or in 8 bits (`8bit` / `paged-8bit`: bitsandbytes' AdamW8bit over the bf16
parameters, torchtune's single-device full fine-tune of Llama 3.1 8B on a 24 GB card, 2 bytes per parameter
of states): bitsandbytes writes the bf16 parameters itself, rounded to nearest (on the CPU, where memtrain
checks it), so updates below half a bf16 ulp are lost there, as they are in torchtune. The other optimizers
and 4-bit states would round the update to nearest with no such precedent and are refused, as DeepSpeed is
(its bf16 mode keeps fp32 masters: bf16-mixed). FSDP2 shards the bf16
parameters as they are (no mixed-precision policy: gathers and reductions in bf16).

Precision changes numerics, so the planner only picks among the names a recipe allows. fp16-mixed
skips steps whose gradients are not finite and lowers the loss scale; the trainer counts those skips.

Frozen parameters (a LoRA/QLoRA base: embeddings, head, norms and unquantised linears; modules a trainer
subclass freezes) are stored in the forward's compute dtype under the autocast precisions
(`strategies.frozen_dtype: compute`, the default): a frozen weight has no update to protect, so it needs
no fp32 copy, and autocast would cast it to the compute dtype for every matmul anyway (a copy the
backward keeps). `frozen_dtype: fp32` keeps them in `stored_dtype` as the trainable ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from memtrain.errors import Unsupported
from memtrain.memory.footprint import Footprint, ModelShape
from memtrain.strategies.master_weights import MasterWeightOptimizer
from memtrain.strategies.optimizer import OptimizerStates, StochasticBF16States
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy, option


@dataclass(frozen=True)
class Precision(Strategy):
    """fp32: everything in fp32. Subclasses change what they name in their class attributes.

    Facts the planner reads: `autocast_dtype` (the forward's compute dtype, None without autocast),
    `stored_dtype` (parameters and gradients), `master_weights` (fp32 copies kept by the optimizer),
    `compute` (the matmul rate class the step-time model uses) and `needs_bf16`.
    """

    kind: ClassVar[str] = "precision"
    name: ClassVar[str] = "fp32"
    autocast_dtype: ClassVar[torch.dtype | None] = None
    stored_dtype: ClassVar[torch.dtype] = torch.float32
    master_weights: ClassVar[bool] = False
    compute: ClassVar[str] = "fp32"
    needs_bf16: ClassVar[bool] = False
    preserves_numerics: ClassVar[bool] = True  # trains numerically like fp32 (what `auto` may choose)
    frozen_dtype: str = option(
        "compute",
        recipe_key="frozen_dtype",
        recipe_type=Literal["compute", "fp32"],
        doc="Frozen parameters under bf16-mixed/fp16-mixed/fp8: compute (stored in the forward's dtype) or fp32.",
        changes_trajectory=True,
    )

    @property
    def frozen_stored_dtype(self) -> torch.dtype:
        """The dtype frozen parameters are stored in: the forward's compute dtype under autocast unless
        `frozen_dtype` is fp32; otherwise `stored_dtype`, as the trainable ones."""
        if self.frozen_dtype == "compute" and self.autocast_dtype is not None:
            return self.autocast_dtype
        return self.stored_dtype

    def describe(self) -> str:
        """`Strategy.describe`, naming `frozen_dtype` where it changes the bytes (`bf16-mixed(frozen=fp32)`)
        rather than a bare `fp32`, and not at all where frozen parameters are stored like the others."""
        plain = Strategy.describe(dataclasses.replace(self, frozen_dtype="compute"))
        if self.frozen_stored_dtype != self.stored_dtype or self.autocast_dtype is None:
            return plain
        inner = [plain[len(self.name) + 1 : -1]] if plain != self.name else []
        return f"{self.name}({', '.join([*inner, 'frozen=fp32'])})"

    def check(self, facts: DeviceFacts) -> None:
        if self.needs_bf16 and facts.device_type == "cuda" and not facts.bf16:
            raise Unsupported(
                f"strategies.precision: {self.name} needs a GPU with bf16 (compute capability >= 8.0); "
                "use fp16-mixed or fp32"
            )

    # ------------------------------------------------------------------ application (setup order)

    def swap_modules(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Module swaps that must come first in the order (fp8's float8 linears)."""

    def build_optimizer(
        self, model: nn.Module, build: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """The optimizer over the trainable parameters (master-weight precisions wrap it)."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        if self.master_weights:
            return MasterWeightOptimizer(trainable, build)
        return build(trainable)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return None

    def update_states(self, stored: OptimizerStates, optimizer: str = "adamw") -> OptimizerStates:
        """The states AdamW steps with under this precision: `stored` (`strategies.optimizer_states`) as
        it is, except under bf16-true. `Unsupported`, naming the key, when `optimizer` (`optimizer.name`)
        or `stored` cannot train under this precision."""
        return stored

    @contextlib.contextmanager
    def autocast(self, device: torch.device) -> Iterator[None]:
        """The context the forward pass and the loss run in."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=device.type, dtype=self.autocast_dtype):
            yield

    # ------------------------------------------------------------------ bytes

    def estimate(self, shape: ModelShape, footprint: Footprint) -> Footprint:
        """The most bytes each model-state component reaches in a step, by precision.

        Trainable parameters are stored at `stored_dtype`, frozen ones at `frozen_stored_dtype`; only
        trainable ones get gradients. With master weights (bf16-master) the gradients peak at 4 B per
        trainable parameter when the bf16 gradients become fp32 master gradients for the optimizer step,
        and the fp32 master copy (4 B per trainable parameter) is added to the optimizer states (the
        optimizer-state strategy adds its moments on top).
        Autocast precisions keep fp32 trainable weights and gradients (autocast casts per op: activations).
        """
        stored = self.stored_dtype.itemsize
        trainable = shape.trainable_numel
        weights = stored * trainable + self.frozen_stored_dtype.itemsize * (shape.numel - trainable)
        if self.master_weights:
            return footprint.with_(
                weights=weights,
                gradients=4 * trainable,
                optimizer_states=footprint.optimizer_states + 4 * trainable,
            )
        return footprint.with_(weights=weights, gradients=stored * trainable)


PRECISION: Registry[Precision] = Registry(
    "precision",
    Precision,
    RecipeKey(
        "strategies",
        "precision",
        "fp32",
        "The dtypes of weights, compute and gradients (fp32, bf16-mixed, bf16-master, bf16-true, fp16-mixed, "
        "fp8).",
        changes_trajectory=True,
    ),
)
PRECISION.register(Precision)


@PRECISION.register
@dataclass(frozen=True)
class BF16Mixed(Precision):
    """fp32 weights, gradients and optimizer; the forward under bf16 autocast."""

    name: ClassVar[str] = "bf16-mixed"
    autocast_dtype: ClassVar[torch.dtype | None] = torch.bfloat16
    compute: ClassVar[str] = "bf16"
    needs_bf16: ClassVar[bool] = True


@PRECISION.register
@dataclass(frozen=True)
class BF16Master(Precision):
    """bf16 parameters and gradients; the optimizer steps fp32 master copies."""

    name: ClassVar[str] = "bf16-master"
    stored_dtype: ClassVar[torch.dtype] = torch.bfloat16
    master_weights: ClassVar[bool] = True
    compute: ClassVar[str] = "bf16"
    needs_bf16: ClassVar[bool] = True
    preserves_numerics: ClassVar[bool] = False


@PRECISION.register
@dataclass(frozen=True)
class BF16True(Precision):
    """bf16 parameters, gradients and AdamW moments, no fp32 copy; the update is written to the bf16
    weights with stochastic rounding (`StochasticBF16AdamW`)."""

    name: ClassVar[str] = "bf16-true"
    stored_dtype: ClassVar[torch.dtype] = torch.bfloat16
    compute: ClassVar[str] = "bf16"
    needs_bf16: ClassVar[bool] = True
    preserves_numerics: ClassVar[bool] = False

    def update_states(self, stored: OptimizerStates, optimizer: str = "adamw") -> OptimizerStates:
        if optimizer != "adamw":
            raise Unsupported(
                f"optimizer.name: {optimizer} under strategies.precision=bf16-true would round its updates of "
                "the bf16 weights to nearest and lose the small ones (only adamw rounds them stochastically "
                "here); use optimizer.name=adamw, or strategies.precision=bf16-master or bf16-mixed"
            )
        if stored.name in ("8bit", "paged-8bit"):
            return stored  # bitsandbytes steps the bf16 parameters (rounded to nearest: the module doc)
        if stored.name not in ("fp32", "bf16"):
            raise Unsupported(
                f"strategies.optimizer_states: {stored.name} under strategies.precision=bf16-true would round "
                "the updates of the bf16 weights to nearest; use optimizer_states fp32 or bf16 (both keep bf16 "
                f"moments here, 4 bytes per parameter), 8bit, or strategies.precision=bf16-master with "
                f"{stored.name}"
            )
        return StochasticBF16States()


@PRECISION.register
@dataclass(frozen=True)
class FP16Mixed(Precision):
    """fp16 autocast with dynamic loss scaling; steps with non-finite gradients are skipped."""

    name: ClassVar[str] = "fp16-mixed"
    autocast_dtype: ClassVar[torch.dtype | None] = torch.float16
    compute: ClassVar[str] = "fp16"
    preserves_numerics: ClassVar[bool] = False

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(device.type)


@PRECISION.register
@dataclass(frozen=True)
class FP8(Precision):
    """torchao float8 training for the blocks' linears; bf16 autocast elsewhere."""

    name: ClassVar[str] = "fp8"
    autocast_dtype: ClassVar[torch.dtype | None] = torch.bfloat16
    compute: ClassVar[str] = "fp8"
    needs_bf16: ClassVar[bool] = True
    preserves_numerics: ClassVar[bool] = False
    emulate: bool = option(
        False,
        recipe_key="fp8_emulate",
        doc="fp8 through torchao's emulation (CPU, debugging).",
        changes_trajectory=True,
    )

    def check(self, facts: DeviceFacts) -> None:
        super().check(facts)
        if importlib.util.find_spec("torchao") is None:
            raise Unsupported("strategies.precision: fp8 needs torchao; pip install 'memtrain[fp8]'")
        if self.emulate:
            return
        if facts.device_type != "cuda":
            raise Unsupported(
                "strategies.precision: fp8 needs a CUDA GPU with compute capability >= 8.9 (H100, L4, "
                "RTX 4090); found none. Use bf16-mixed, or strategies.fp8_emulate=true to emulate"
            )
        if not facts.fp8:
            raise Unsupported(
                "strategies.precision: fp8 needs compute capability >= 8.9 (H100, L4, RTX 4090); "
                "use bf16-mixed"
            )

    def swap_modules(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Replace the blocks' nn.Linear layers by torchao Float8Linear (first in the order)."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        block_ids = {id(b) for b in blocks}
        inside = {name for name, m in model.named_modules() if id(m) in block_ids}

        def in_a_block(module: nn.Module, fqn: str) -> bool:
            dims_ok = (
                isinstance(module, nn.Linear)
                and module.in_features % 16 == 0
                and module.out_features % 16 == 0
            )
            return dims_ok and any(fqn.startswith(prefix + ".") for prefix in inside)

        config = Float8LinearConfig(emulate=self.emulate)
        convert_to_float8_training(model, module_filter_fn=in_a_block, config=config)
