"""Where the AdamW moments live, and how many bytes they cost: the optimizer-state strategy.

The two Adam moments are the largest model state in fp32 training (8 of 16 bytes per parameter), and
the cheapest to shrink without touching the forward pass. Names:

- `fp32`: `torch.optim.AdamW` with its defaults, exactly what the trainer builds without a plan. Its
  moments follow the parameter dtype (fp32 parameters: 4 + 4 bytes; bf16 parameters: 2 + 2), plus a
  0-dim float32 `step` tensor per parameter tensor (on the CPU unless fused/capturable).
- `bf16`: `BF16StateAdamW` (lowbit_adamw.py): torch's update rule in fp32, moments stored in bf16
  with stochastic rounding, whatever the parameter dtype; `step` is a Python int.
- `8bit`: bitsandbytes `AdamW8bit`: blockwise-quantised uint8 moments (1 + 1 bytes) plus one fp32
  absmax per 256 elements per moment; tensors under `BNB_MIN_8BIT_SIZE` elements keep fp32 moments
  whatever the parameter dtype; the two 256-entry fp32 quantisation maps are shared by all tensors.
- `paged-8bit`: the same in CUDA unified memory (`PagedAdamW8bit`), so the driver can evict states to
  host RAM under pressure instead of failing. Same bytes as `8bit` (an upper bound for what is
  resident; the states do not show in torch's allocator statistics).

`estimate` is the arithmetic the planner uses (checked to the byte by the tests against
`measured_state_bytes` after a real step); the bitsandbytes constants below were read from
bitsandbytes/optim/optimizer.py (`Optimizer2State.init_state`, 0.50).

bitsandbytes state dicts load with `torch.load(weights_only=True)` as they are (tensors, ints, floats,
None, tuples), so checkpoints need no conversion.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import ParamsT

from memtrain.errors import Unsupported
from memtrain.memory.footprint import Footprint, ModelShape
from memtrain.strategies.lowbit_adamw import BF16StateAdamW, local_tensor
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy

BNB_MIN_8BIT_SIZE = 4096  # tensors with fewer elements keep fp32 states (passed to bitsandbytes by `build`)
BNB_BLOCK_SIZE = 256  # elements per fp32 absmax, hard-coded in bitsandbytes' init_state
BNB_QMAP_BYTES = 2 * 256 * 4  # the signed and unsigned dynamic maps, 256 fp32 entries each
STEP_TENSOR_BYTES = 4  # torch AdamW's per-parameter 0-dim float32 `step`


@dataclass(frozen=True)
class OptimizerStates(Strategy):
    """`fp32`: torch AdamW. Subclasses store the moments differently.

    Facts the planner reads: `per_tensor_temporaries` / `foreach_temporaries` (fp32 copies of the largest
    tensor, or of all parameters, that the step holds: measured with the tracker, tests in
    tests/planner/test_memory_model.py), `per_tensor_carried` (copies of one tensor a per-tensor step still
    holds during the next tensor's: torch AdamW's `denom`, a loop variable) and `relative_step_cost` (seconds per byte streamed relative to
    fp32 AdamW, per device class; measured on this CPU, estimated for CUDA).
    """

    kind: ClassVar[str] = "optimizer_states"
    name: ClassVar[str] = "fp32"
    per_tensor_temporaries: ClassVar[int] = 2
    per_tensor_carried: ClassVar[int] = 1  # torch's `_single_tensor_adam` keeps `denom` into the next tensor
    foreach_temporaries: ClassVar[int | None] = 1  # None: no multi-tensor path
    per_tensor_step_bytes: ClassVar[int] = STEP_TENSOR_BYTES  # the 0-dim `step` tensor per parameter tensor
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.0, "cpu": 1.0}

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        """Bytes of the states of the (trainable) parameters in `shape` after the first step."""
        return 2 * shape.numel * param_bytes + STEP_TENSOR_BYTES * len(shape.params)

    def estimate(self, shape: ModelShape, footprint: Footprint, param_bytes: int = 4) -> Footprint:
        """`footprint` with the bytes this optimizer holds after its first step added to `optimizer_states`
        (added, because a precision may already have put its fp32 master copy there).

        `param_bytes` is the element size of the parameters the optimizer is given; only `fp32`
        (torch AdamW, moments in the parameter dtype) depends on it. Only trainable parameters get states
        (the trainer builds the optimizer over them; a parameter that never receives a gradient has none).
        """
        states = self.state_bytes(shape.trainable, param_bytes)
        return footprint.with_(optimizer_states=footprint.optimizer_states + states)


OPTIMIZER_STATES: Registry[OptimizerStates] = Registry(
    "optimizer_states",
    OptimizerStates,
    RecipeKey(
        "strategies",
        "optimizer_states",
        "fp32",
        "How AdamW's two moments are stored: fp32, bf16, 8bit or paged-8bit (bitsandbytes).",
        changes_trajectory=True,
    ),
)
OPTIMIZER_STATES.register(OptimizerStates)


@OPTIMIZER_STATES.register
@dataclass(frozen=True)
class BF16States(OptimizerStates):
    """`BF16StateAdamW`: fp32 update rule, moments stored in bf16 with stochastic rounding."""

    name: ClassVar[str] = "bf16"
    per_tensor_temporaries: ClassVar[int] = 6
    per_tensor_carried: ClassVar[int] = 0
    foreach_temporaries: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = 0
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.6, "cpu": 3.2}

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        return BF16StateAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        return 2 * shape.numel * 2


def _own_override_manager(name: str) -> Any:
    """A bitsandbytes override manager of the optimizer's own, holding no override. bitsandbytes keeps one
    per process and keys its overrides by (group, position): after an HF Trainer with an 8-bit optimizer
    ran in the process (it makes every embedding's states 32-bit), the parameters at the same positions
    of this optimizer got 32-bit states too: bytes the plan did not count (measured: the tiny Llama's
    embedding, 8,192 elements, +48,896 bytes)."""
    manager_class = _bitsandbytes(name).optim.GlobalOptimManager
    manager = manager_class.__new__(manager_class)  # its __init__ refuses: it means to be a singleton
    manager.initialize()
    return manager


@OPTIMIZER_STATES.register
@dataclass(frozen=True)
class EightBitStates(OptimizerStates):
    """bitsandbytes `AdamW8bit`: blockwise-quantised uint8 moments."""

    name: ClassVar[str] = "8bit"
    per_tensor_temporaries: ClassVar[int] = 0
    per_tensor_carried: ClassVar[int] = 0
    foreach_temporaries: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = 0
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.2, "cpu": 6.6}

    def check(self, facts: DeviceFacts) -> None:
        """Installed (found, not imported: `validate` builds every candidate, and bitsandbytes costs seconds
        to import; `build` imports it, with the same one line when that fails)."""
        if importlib.util.find_spec("bitsandbytes") is None:
            _bitsandbytes(self.name)

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        optimizer = self._optimizer_class()(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, min_8bit_size=BNB_MIN_8BIT_SIZE
        )
        optimizer.mng = _own_override_manager(self.name)
        return optimizer

    def _optimizer_class(self) -> Any:
        return _bitsandbytes(self.name).optim.AdamW8bit

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        states = sum(_bnb_tensor_bytes(p.numel) for p in shape.params)
        if any(p.numel >= BNB_MIN_8BIT_SIZE for p in shape.params):
            states += BNB_QMAP_BYTES
        return states


@OPTIMIZER_STATES.register
@dataclass(frozen=True)
class PagedEightBitStates(EightBitStates):
    """The same in CUDA unified memory (`PagedAdamW8bit`): the driver may evict states to host RAM."""

    name: ClassVar[str] = "paged-8bit"
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.4, "cpu": 6.6}

    def check(self, facts: DeviceFacts) -> None:
        super().check(facts)
        if facts.device_type != "cuda":
            raise Unsupported(
                f"strategies.optimizer_states: paged-8bit needs CUDA (found device {facts.device_type}); "
                "use 8bit or fp32 (strategies.optimizer_states)"
            )

    def _optimizer_class(self) -> Any:
        return _bitsandbytes(self.name).optim.PagedAdamW8bit


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the tensors in `optimizer.state` (this rank's shards).

    Storages are counted once however many entries share them (bitsandbytes' quantisation maps).
    """
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            storage = local_tensor(value).untyped_storage()
            key = (storage.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _bnb_tensor_bytes(numel: int) -> int:
    if numel < BNB_MIN_8BIT_SIZE:
        return 2 * numel * 4
    return 2 * numel + 2 * math.ceil(numel / BNB_BLOCK_SIZE) * 4


def _bitsandbytes(name: str) -> ModuleType:
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as exc:
        raise Unsupported(
            f"strategies.optimizer_states: {name} needs bitsandbytes, which cannot be imported ({exc}); "
            "pip install 'memtrain[bnb]', or use fp32 or bf16"
        ) from None
