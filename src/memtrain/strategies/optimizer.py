"""Where the AdamW moments live, and how many bytes they cost: the optimizer-state strategy.

The two Adam moments are the largest model state in fp32 training (8 of 16 bytes per parameter), and
the cheapest to shrink without touching the forward pass. Names:

- `fp32`: `torch.optim.AdamW`, fused (`fused=True`) wherever torch supports it for the parameters (floating
  parameters on CUDA or the CPU, FSDP2's DTensors of a 1-D mesh included; not with plain and distributed
  parameters mixed, which torch's fused kernel refuses, nor on 2-D meshes), torch's default path otherwise. The
  planner charges the fused step's temporaries (none) on every mesh: a 2-D mesh's foreach copy of the local
  shards is not counted (small beside the sharded states; a known gap). Its moments
  follow the parameter dtype (fp32 parameters: 4 + 4 bytes; bf16 parameters: 2 + 2), plus a 0-dim float32
  `step` tensor per parameter tensor (on the parameters' device when fused). Why fused: it updates every
  tensor in place in one kernel, holding no temporaries, where torch's CUDA default (foreach) holds an fp32
  copy of all parameters and its per-tensor path two of the largest tensor; the update is the same up to
  float rounding (tests/strategies/test_optimizer_states.py).
- `bf16`: `BF16StateAdamW` (lowbit_adamw.py): torch's update rule in fp32, moments stored in bf16
  with stochastic rounding, whatever the parameter dtype; `step` is a Python int.
- under `strategies.precision: bf16-true`, `fp32` and `bf16` both become `StochasticBF16States`
  (`bf16-sr`, not a recipe name): the bf16 states' AdamW that also writes the bf16 parameters with
  stochastic rounding (`Precision.update_states`); 2 + 2 bytes, no `step` tensor. `8bit` / `paged-8bit`
  stay bitsandbytes' (torchtune's single-device full fine-tune): its kernel writes the bf16 parameters
  rounded to nearest.
- `8bit`: bitsandbytes `AdamW8bit`: blockwise-quantised uint8 moments (1 + 1 bytes) plus one fp32
  absmax per 256 elements per moment; tensors under `BNB_MIN_8BIT_SIZE` elements keep fp32 moments
  whatever the parameter dtype; the two 256-entry fp32 quantisation maps are shared by all tensors.
- `paged-8bit`: the same in CUDA unified memory (`PagedAdamW8bit`), so the driver can evict states to
  host RAM under pressure instead of failing. Same bytes as `8bit`; the moments of tensors of at least
  100k elements are paged (`paged_bytes`): they do not show in torch's allocator statistics (nor in the
  peaks torchtune publishes), and the planner holds them to host memory, not to the device's budget.
- `4bit`: torchao's `AdamW4bit` (stepped eagerly, `fourbit_adamw.py`): blockwise 4-bit moments (0.5 + 0.5
  bytes) plus one fp32 scale per 128 elements per moment and a 64-byte code map per state tensor; tensors
  under 4096 elements (or not whole blocks) keep moments in the parameter dtype; a 4-byte `step` each.

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
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import ParamsT

from memtrain.errors import Unsupported
from memtrain.memory._torch_private import fused_optimizer_steps
from memtrain.memory.footprint import Footprint, ModelShape
from memtrain.memory.ledger import storages_of
from memtrain.strategies.lowbit_adamw import CHUNK_NUMEL, BF16StateAdamW, StochasticBF16AdamW, local_tensor
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy

BNB_MIN_8BIT_SIZE = 4096  # tensors with fewer elements keep fp32 states (passed to bitsandbytes by `build`)
BNB_BLOCK_SIZE = 256  # elements per fp32 absmax, hard-coded in bitsandbytes' init_state
BNB_QMAP_BYTES = 2 * 256 * 4  # the signed and unsigned dynamic maps, 256 fp32 entries each
BNB_MIN_PAGED_SIZE = 100_000  # paged optimizers keep smaller tensors' states as ordinary device tensors
STEP_TENSOR_BYTES = 4  # torch AdamW's per-parameter 0-dim float32 `step`
AO_MIN_4BIT_SIZE = 4096  # torchao's low-bit AdamW: smaller tensors keep states in the parameter dtype
AO_BLOCK_SIZE = 128  # AdamW4bit's default elements per fp32 scale
AO_QMAP_BYTES = 16 * 4  # each 4-bit state's own 16-entry fp32 code map


@dataclass(frozen=True)
class OptimizerStates(Strategy):
    """`fp32`: torch AdamW. Subclasses store the moments differently.

    Facts the planner reads: `per_tensor_temporaries` / `foreach_temporaries` / `fused_temporaries` (fp32
    copies of the largest tensor, or of all parameters, that the step holds: measured with the tracker, tests
    in tests/planner/test_memory_model.py; `fused_temporaries` None: no fused path, else the planner takes
    it, as `build` does), `step_chunk_numel` (a per-tensor step that works on flat chunks of at most this
    many elements holds its temporaries over one chunk, not the whole tensor; None: whole tensors),
    `per_tensor_carried` (copies of one tensor a per-tensor step still holds during the next tensor's: torch
    AdamW's `denom`, a loop variable), `relative_step_cost` (seconds per byte streamed relative to fp32
    AdamW, per device class; measured on this CPU, estimated for CUDA) and `shape_dependent` (the states'
    bytes follow each tensor's shape: the sharding arithmetic takes them tensor by tensor).
    """

    kind: ClassVar[str] = "optimizer_states"
    name: ClassVar[str] = "fp32"
    per_tensor_temporaries: ClassVar[int] = 2
    per_tensor_carried: ClassVar[int] = 1  # torch's `_single_tensor_adam` keeps `denom` into the next tensor
    foreach_temporaries: ClassVar[int | None] = 1  # None: no multi-tensor path
    fused_temporaries: ClassVar[int | None] = 0  # torch's fused AdamW updates in place
    step_chunk_numel: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = STEP_TENSOR_BYTES  # the 0-dim `step` tensor per parameter tensor
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.0, "cpu": 1.0}
    shape_dependent: ClassVar[bool] = False  # bytes follow each tensor's shape, not only its size

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        """torch AdamW, fused where torch supports it for every parameter (floating, on a device with fused
        kernels: torch would refuse only at the first step), its default path otherwise."""
        given: list[Any] = list(params)
        fused = _fused_steps(list(_tensors(given))) or None
        return torch.optim.AdamW(given, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused)

    def step_elements(self, numel: int) -> int:
        """Elements of a tensor of `numel` whose temporaries the per-tensor step holds at once."""
        return numel if self.step_chunk_numel is None else min(numel, self.step_chunk_numel)

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

    def paged_bytes(self, shape: ModelShape) -> int:
        """Of `state_bytes(shape)`, the bytes in CUDA unified memory, which the driver evicts to host memory
        rather than fail an allocation: outside the device peak torch's allocator sees and limits."""
        return 0


OPTIMIZER_STATES: Registry[OptimizerStates] = Registry(
    "optimizer_states",
    OptimizerStates,
    RecipeKey(
        "strategies",
        "optimizer_states",
        "fp32",
        "How AdamW's two moments are stored: fp32, bf16, 8bit or paged-8bit (bitsandbytes), 4bit (torchao).",
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
    fused_temporaries: ClassVar[int | None] = None
    step_chunk_numel: ClassVar[int | None] = CHUNK_NUMEL  # `BF16StateAdamW` steps a tensor chunk by chunk
    per_tensor_step_bytes: ClassVar[int] = 0
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.6, "cpu": 3.2}

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        return BF16StateAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        return 2 * shape.numel * 2


@dataclass(frozen=True)
class StochasticBF16States(BF16States):
    """`StochasticBF16AdamW` (`bf16-true`'s states, not registered): bf16 moments, and the bf16 parameters
    written with stochastic rounding. Over bf16 parameters the step's fp32 copies of the parameter and of
    its gradient are temporaries too (8 fp32 copies of the tensor in all: parameter, gradient, moments,
    denominator, and the rounding's noise, sum and result); the rounding of the parameter costs one
    more pass than `bf16`'s step (estimated from the update rule, not measured)."""

    name: ClassVar[str] = "bf16-sr"
    per_tensor_temporaries: ClassVar[int] = 8
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 1.8, "cpu": 3.8}

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        return StochasticBF16AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _fused_steps(tensors: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW steps these parameters: torch's check for each, and either no DTensor or
    all of them DTensors of one 1-D mesh (FSDP2 over one dimension, tested on one and two ranks). With plain
    and distributed parameters mixed, torch 2.13's `_fused_adamw_` refuses at the first step ("got mixed
    torch.Tensor and DTensor": every FSDP x TP, TP and pipeline run of tests/parallel/test_mesh.py did);
    2-D meshes (HSDP, FSDP x TP) take the default path too: fused on them is not tested on several ranks."""
    from torch.distributed.tensor import DTensor  # here: `memtrain --help` does not import it

    if not all(fused_optimizer_steps(t) for t in tensors):
        return False
    meshes = {t.device_mesh for t in tensors if isinstance(t, DTensor)}
    if not meshes:
        return True
    return len(meshes) == 1 and next(iter(meshes)).ndim == 1 and all(isinstance(t, DTensor) for t in tensors)


def _tensors(params: list[Any]) -> Iterator[torch.Tensor]:
    """The parameters of `params` as an optimizer takes them: tensors, (name, tensor) pairs or param groups."""
    for entry in params:
        if isinstance(entry, dict):
            group = entry["params"]
            yield from _tensors([group] if isinstance(group, torch.Tensor) else list(group))
        else:
            yield entry[1] if isinstance(entry, tuple) else entry


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
    fused_temporaries: ClassVar[int | None] = None
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

    def paged_bytes(self, shape: ModelShape) -> int:
        """The two uint8 moments of each tensor of at least `BNB_MIN_PAGED_SIZE` elements (bitsandbytes'
        `get_state_buffer`, 0.50); the absmax blocks, the maps and smaller tensors' states are ordinary device
        tensors."""
        return sum(2 * p.numel for p in shape.params if p.numel >= BNB_MIN_PAGED_SIZE)


@OPTIMIZER_STATES.register
@dataclass(frozen=True)
class FourBitStates(OptimizerStates):
    """torchao's `AdamW4bit`, stepped eagerly (`fourbit_adamw.EagerAdamW4bit`): blockwise 4-bit moments."""

    name: ClassVar[str] = "4bit"
    per_tensor_temporaries: ClassVar[int] = 8
    per_tensor_carried: ClassVar[int] = 0
    foreach_temporaries: ClassVar[int | None] = None
    fused_temporaries: ClassVar[int | None] = None
    per_tensor_step_bytes: ClassVar[int] = STEP_TENSOR_BYTES
    relative_step_cost: ClassVar[dict[str, float]] = {"cuda": 2.0, "cpu": 8.0}

    def check(self, facts: DeviceFacts) -> None:
        _fourbit_module()

    def build(
        self, params: ParamsT, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
    ) -> torch.optim.Optimizer:
        optimizer: torch.optim.Optimizer = _fourbit_module().EagerAdamW4bit(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay
        )
        return optimizer

    def state_bytes(self, shape: ModelShape, param_bytes: int) -> int:
        return sum(_ao_tensor_bytes(p.numel, param_bytes) for p in shape.params)


def _ao_tensor_bytes(numel: int, param_bytes: int) -> int:
    """One parameter's two moments and its `step`: 4-bit codes, an fp32 scale per block and a 16-entry fp32
    map each when the tensor has at least 4096 elements and whole blocks (torchao's `_new_buffer`)."""
    if numel >= AO_MIN_4BIT_SIZE and numel % AO_BLOCK_SIZE == 0:
        moment = numel // 2 + numel // AO_BLOCK_SIZE * 4 + AO_QMAP_BYTES
    else:
        moment = numel * param_bytes
    return 2 * moment + STEP_TENSOR_BYTES


def _fourbit_module() -> ModuleType:
    try:
        return importlib.import_module("memtrain.strategies.fourbit_adamw")
    except ImportError as exc:
        raise Unsupported(
            f"strategies.optimizer_states: 4bit needs torchao, which cannot be imported ({exc}); "
            "pip install 'memtrain[fp8]', or use 8bit, bf16 or fp32"
        ) from None


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the tensors in `optimizer.state` (this rank's shards).

    Storages are counted once however many entries share them (bitsandbytes' quantisation maps); a
    wrapper subclass (torchao's 4-bit states) counts the storages of its inner tensors.
    """
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            for storage in storages_of(local_tensor(value)):  # through torchao's 4-bit subclass
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
