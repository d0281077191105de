"""What the planner knows about the trainer's model before building it: its shape and its traced activations.

The shape (every parameter's size, block and whether it trains; leading dimensions for FSDP2's padding;
buffer bytes) comes from the trainer's `build_model()` on the meta device: no memory, a 70B model in
about a second. Activations come from `activations.trace_step` under fake tensors, at two micro-batch
sizes, once per (precision, checkpointing mode, loss); the fits are cached, so a search over hundreds of
candidates costs a handful of traces. When the trainer can build the model at a reduced depth
(`ModelSpec.build_clone`), a clone of at most three blocks is traced; otherwise the whole model is.

Why the smallest and the largest micro-batch the search considers as the two traced sizes: within a
segment the peak is the highest of many moments, each linear in the rows, so it is convex in the rows and
a straight line can only be exact where it was measured. Through the two ends of the range the line is
exact there and on the safe side in between.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from memtrain.errors import MemtrainError, Unsupported
from memtrain.memory.footprint import ModelShape
from memtrain.planner.activations import FittedTrace, clone_depth, fit, trace_step
from memtrain.planner.attention_kernels import Capability
from memtrain.planner.spec import Batch, ModelSpec
from memtrain.planner.trace_fallback import clone_step_bytes, trace_for_real
from memtrain.strategies.adapters import Adapters
from memtrain.strategies.blocks import model_shape, output_head
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.loss import Loss
from memtrain.strategies.precision import Precision
from memtrain.strategies.quantization import Quantization


@dataclass
class ModelProbe:
    """The trainer's model as the planner sees it; `progress` receives a line per trace."""

    spec: ModelSpec
    progress: Callable[[str], None] = field(default=lambda _line: None)
    adapters: Adapters = field(default_factory=Adapters)  # the recipe's: they change what trains
    quantization: Quantization = field(default_factory=Quantization)  # the recipe's base quantisation
    shape: ModelShape = field(init=False)
    dim0: dict[str, int] = field(init=False)
    buffer_bytes: int = field(init=False)
    hidden_size: int = field(init=False)
    linear_weights: frozenset[str] = field(init=False)  # what base quantisation would store in 4/8 bits
    seq_len: int = field(init=False)
    row_bytes: int = field(init=False)
    head_numel: int = field(init=False)  # the output head's weight (what `chunked` recomputes)
    _fits: dict[
        tuple[Precision, Checkpointing, tuple[int, int], torch.dtype | None, Loss, Capability | None],
        FittedTrace,
    ] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        try:
            with torch.device("meta"):
                model = self.spec.build_model()
                blocks = self.spec.blocks(model)
                self.adapters.apply(model)
        except MemtrainError:
            raise
        except Exception as exc:
            raise Unsupported(
                f"cannot build {self.spec.name} on the meta device to plan it: "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        self.shape = model_shape(model, blocks)
        head = output_head(model)
        weight = None if head is None else getattr(model.get_submodule(head), "weight", None)
        self.head_numel = weight.numel() if isinstance(weight, torch.Tensor) else 0
        self.linear_weights = frozenset(
            f"{name}.weight"
            for name, module in model.named_modules()
            if type(module) is nn.Linear and name != head and not self.adapters.owns(f"{name}.weight")
        )
        self.dim0 = {name: p.shape[0] if p.dim() else 1 for name, p in model.named_parameters()}
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self.hidden_size = _hidden_size(blocks)
        one_row = self.spec.micro_batch(1)
        self.seq_len = max((t.numel() for t in one_row.values()), default=1)
        self.row_bytes = _nbytes(one_row)

    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    def step_data_bytes(self, rows: int) -> int:
        """The step batch of this rank on the device (the trainer moves every micro-batch of a step at once)."""
        return rows * self.row_bytes

    def trace(
        self,
        precision: Precision,
        mode: Checkpointing,
        rows: tuple[int, int],
        weights_dtype: torch.dtype | None = None,
        loss: Loss | None = None,
        cuda_capability: Capability | None = None,
    ) -> FittedTrace:
        """The activation fit for one precision and one traced checkpointing mode, drawn through traces at
        the smallest and the largest micro-batch rows the search considers (cached). `weights_dtype`: the
        sharding backend hands the forward weights of this dtype (FSDP2's and DeepSpeed's bf16-mixed).
        `loss`: the plan's loss strategy (standard by default). `cuda_capability`: trace attention as the CUDA
        kernel of a GPU of this compute capability (attention_kernels.py); None: this CPU's kernels."""
        loss = loss or Loss()
        if rows[0] == rows[1]:
            rows = (rows[0], 2 * rows[0])
        key = (precision, mode, rows, weights_dtype, loss, cuda_capability)
        if key not in self._fits:
            clone = self.spec.build_clone
            depth = clone_depth(self.num_blocks) if clone is not None else self.num_blocks
            weights = f", {str(weights_dtype).removeprefix('torch.')} weights" if weights_dtype else ""
            weights += f", loss {loss.describe()}" if loss.name != "standard" else ""
            self.progress(
                f"tracing {precision.describe()}{weights} / checkpointing {mode.describe()} ({depth} of "
                f"{self.num_blocks} blocks, {rows[0]} and {rows[1]} x {self.seq_len} tokens)"
            )
            build = (lambda: clone(depth)) if clone is not None else self.spec.build_model

            def traced() -> FittedTrace:
                small, large = (
                    trace_step(
                        build,
                        self.spec.blocks,
                        self._batch,
                        self.spec.loss,
                        precision,
                        mode,
                        count,
                        weights_dtype,
                        self.adapters,
                        self.quantization,
                        loss,
                        cuda_capability,
                    )
                    for count in rows
                )
                return fit(small, large)

            try:
                self._fits[key] = traced()
            except MemtrainError:
                raise
            except Exception as exc:  # a model or kernel the fake-tensor trace cannot run: real tensors
                cause = f"{type(exc).__name__}: {_first_line(exc)}"
                tokens = rows[1] * self.seq_len
                size = clone_step_bytes(self.shape, depth, tokens, self.hidden_size, self.head_numel)
                self._fits[key] = trace_for_real(self.spec.name, cause, size, traced, self.progress)
        return self._fits[key]

    def _batch(self, rows: int) -> Batch:
        return self.spec.micro_batch(rows)


def _hidden_size(blocks: list[nn.Module]) -> int:
    """The width the blocks work at: the commonest last dimension of the first block's parameters (the
    input features of its projections and the size of its norms)."""
    if not blocks:
        return 0
    widths = Counter(p.shape[-1] for p in blocks[0].parameters() if p.dim())
    return widths.most_common(1)[0][0] if widths else 0


def _nbytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
