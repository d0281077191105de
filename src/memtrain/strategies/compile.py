"""Compilation (`strategies.compile`): run the blocks, or the whole model, as Inductor-compiled programs.

Why a strategy: a compiled step is, for most GPU users, the fastest plan (torchtitan's Llama 3.1 8B: +16%
throughput; torchtune's 3B: +27% tokens/s) and its memory is not the eager step's (Inductor fuses away
temporaries, and can also keep more). The planner must know a plan is compiled to predict and time it.

- `none`: eager; nothing is touched (no attribute, no hook: a model planned as `none` is the model built).
- `blocks`: each repeated block (`strategies/blocks.py`, the ones checkpointing wraps) is compiled in place
  with `nn.Module.compile()`, as torchtitan's per-block compile: one program per block class, reused by
  every block of it (parameters are graph inputs), so compile time does not grow with depth.
- `model`: the whole model compiled in place the same way (`model.compile()`): the embedding, the head and
  the loss's logits are in the program too, at the price of one long compile and more graph breaks (the
  model's own Python: masks, caches, output capturing).

In place (`nn.Module.compile`, not `torch.compile(module)`): the module tree, parameter names and
state_dict keys do not change, so a checkpoint of a compiled run loads eager and the other way round, and
hooks stay where they were. What `nn.Module.compile` leaves is the module's `_compiled_call_impl`; the
planner reads that attribute (`is_compiled`) to know a model is compiled, so `none` leaves none.

Order (`apply_strategies`, torchtitan's): tensor parallel -> activation checkpointing -> compile per block
-> FSDP2. Checkpointing first: checkpointing replaces the block's `forward` (an instance attribute), and
the compiled `_call_impl` looks `self.forward` up when it is traced, so the compiled program *contains*
the checkpoint, which Dynamo captures as one higher-order op; AOTAutograd's partitioner then saves what
the mode says (`full`: the block's inputs; `selective`: the policy's matmul outputs, torch's SAC under
compile) and recomputes the rest inside the compiled backward. The other order (compile, then wrap the
compiled block in checkpoint) would run an eager `torch.utils.checkpoint` around a compiled call: its
recompute would re-run the compiled forward as a whole, and saved-tensor decisions would be made outside
the program (no SAC policy applies to an opaque compiled call). A side effect inside a checkpointed
region (transformers' hub-kernel routing sets a context variable in the attention's forward) is not
replayed in the recompute: `skip_fwd_side_effects_in_bwd_under_checkpoint` is set for the compiled calls
(the routing is set and reset within the call, so nothing is lost). FSDP2 last: `fully_shard` registers
its hooks on the compiled block, which run around the program as on an eager block.

Precision: autocast is entered by the trainer around the forward, outside the compiled regions, and Dynamo
traces the autocast state into the program: the compiled ops run in the precision's dtypes (tested:
bf16-mixed). fp8's float8 linears are swapped before and compiled with the block, and tensor parallel's
DTensor blocks are compiled after their split, as torchtitan does; neither runs on a CPU, so neither is
tested here.

Refused, naming `strategies.compile`: pipeline stages (the stage's split model is driven by torch's
pipeline schedule; not run by this version), `offload` checkpointing (saved-tensor hooks are not traced by
Dynamo: the block would run eager), DeepSpeed (its ZeRO hooks and parameter partitioning are not
compile-safe on the versions memtrain supports) and devices other than CPU and CUDA.

At run: the first call of each compiled region compiles it. Graph breaks are reported once per region and
reason (a one-line warning naming the block, e.g. `model.layers.0 (LlamaDecoderLayer)`); a region whose
compile fails (an Inductor or Dynamo error) runs eager from then on, with a warning saying so, and is no
longer compiled (`is_compiled` is False for it).
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from memtrain.errors import Unsupported
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy
from memtrain.strategies.sharding import Sharding

COMPILED_DEVICES = ("cpu", "cuda")
_CALL = "_compiled_call_impl"  # what nn.Module.compile() sets


@dataclass(frozen=True)
class Compile(Strategy):
    """`none`: eager. Facts the planner reads: `compiles_blocks`, `compiles_model`."""

    kind: ClassVar[str] = "compile"
    name: ClassVar[str] = "none"
    compiles_blocks: ClassVar[bool] = False
    compiles_model: ClassVar[bool] = False

    @property
    def compiled(self) -> bool:
        return self.compiles_blocks or self.compiles_model

    def check(self, facts: DeviceFacts) -> None:
        if not self.compiled:
            return
        if facts.device_type not in COMPILED_DEVICES:
            raise Unsupported(
                f"strategies.compile: {self.name} compiles with Inductor, which memtrain runs on "
                f"{' and '.join(COMPILED_DEVICES)} only (this device: {facts.device_type}); set "
                "strategies.compile=none"
            )
        if facts.shape.pp > 1:
            raise Unsupported(
                f"strategies.compile: {self.name} with {facts.shape.pp} pipeline stages "
                "(strategies.mesh.pp) is not run by this version; set strategies.compile=none"
            )

    def check_with(self, checkpointing: Checkpointing, sharding: Sharding) -> None:
        """`Unsupported` (naming the keys) when this cannot run with the checkpointing and the sharding."""
        if not self.compiled:
            return
        if checkpointing.offloads_activations:
            raise Unsupported(
                f"strategies.compile: {self.name} with strategies.checkpointing={checkpointing.name}: Dynamo "
                "does not trace saved-tensor hooks (host offload); set strategies.compile=none or another "
                "checkpointing"
            )
        if sharding.name != "none" and sharding.backend == "deepspeed":
            raise Unsupported(
                f"strategies.compile: {self.name} with strategies.sharding_backend=deepspeed is not run by "
                "this version; set strategies.compile=none or strategies.sharding_backend=fsdp2"
            )

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Compile `model`'s regions in place (after checkpointing has wrapped the blocks)."""


COMPILE: Registry[Compile] = Registry(
    "compile",
    Compile,
    RecipeKey(
        "strategies",
        "compile",
        "none",
        "torch.compile (Inductor), in place: none, blocks (each repeated block, after checkpointing wraps it), "
        "model (the whole model); auto: the planner compiles where its calibrated step time says it is "
        "faster or only a compiled plan fits.",
        changes_trajectory=False,
    ),
)
COMPILE.register(Compile)


@COMPILE.register
@dataclass(frozen=True)
class CompileBlocks(Compile):
    """`blocks`: each repeated block compiled in place."""

    name: ClassVar[str] = "blocks"
    compiles_blocks: ClassVar[bool] = True

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        names = {id(m): name for name, m in model.named_modules()}
        for block in blocks:
            compile_in_place(block, f"{names.get(id(block), '?')} ({type(block).__name__})", self.name)


@COMPILE.register
@dataclass(frozen=True)
class CompileModel(Compile):
    """`model`: the whole model compiled in place."""

    name: ClassVar[str] = "model"
    compiles_model: ClassVar[bool] = True

    def apply(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        compile_in_place(model, f"the model ({type(model).__name__})", self.name)


def is_compiled(module: nn.Module) -> bool:
    """Whether `module` runs a compiled program when called (`nn.Module.compile` was applied to it)."""
    return getattr(module, _CALL, None) is not None


def compiled_modules(model: nn.Module) -> list[str]:
    """The names of `model`'s compiled modules ("" for the model itself)."""
    return [name for name, module in model.named_modules() if is_compiled(module)]


def uncompile(modules: list[nn.Module]) -> None:
    """Make `modules` eager again (a re-plan re-compiles after re-wrapping; the next call traces anew)."""
    for module in modules:
        if is_compiled(module):
            setattr(module, _CALL, None)


def compile_in_place(module: nn.Module, where: str, name: str) -> None:
    """`module.compile()` with Inductor, its compiled call reporting graph breaks and falling back to eager."""
    module.compile(backend="inductor")
    compiled = getattr(module, _CALL)
    setattr(module, _CALL, _Region(module, compiled, where, name))


class _Region:
    """One compiled region's call: the compiled program under memtrain's Dynamo settings, its new graph
    breaks reported by name (once per reason), and on a compile error the module's eager call from then on.
    `__wrapped__` is `nn.Module.compile`'s own compiled call."""

    def __init__(self, module: nn.Module, compiled: Callable[..., Any], where: str, name: str) -> None:
        self._module = module
        self._where = where
        self._name = name
        self._reported: set[str] = set()
        functools.update_wrapper(self, compiled)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        breaks = torch._dynamo.utils.counters["graph_break"]
        before = collections.Counter(breaks)
        try:
            with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
                out = self.__wrapped__(*args, **kwargs)  # type: ignore[attr-defined]
        except torch._dynamo.exc.TorchDynamoException as exc:  # Dynamo's and Inductor's (a user error reruns)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            warnings.warn(
                f"strategies.compile={self._name}: {self._where} cannot compile and runs eager "
                f"({type(exc).__name__}: {first[:200]})",
                stacklevel=2,
            )
            setattr(self._module, _CALL, None)
            return self._module(*args, **kwargs)
        new = [
            reason for reason in breaks if breaks[reason] > before[reason] and reason not in self._reported
        ]
        for reason in new:
            self._reported.add(reason)
            line = reason.strip().splitlines()[0] if reason.strip() else "?"
            warnings.warn(
                f"strategies.compile={self._name}: graph break in {self._where}: {line[:200]} "
                "(that part runs eager)",
                stacklevel=2,
            )
        return out
