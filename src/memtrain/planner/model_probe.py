"""What the planner knows about a recipe's model before building it: its shape and its traced activations.

The shape (every parameter's size and block, leading dimensions for FSDP2's padding, buffer bytes) comes
from the model built on the meta device: no memory, a 70B model in about a second. Activations come from
`activations.trace_step` on a clone of at most three blocks under fake tensors, at two micro-batch sizes of the
recipe's sequence length, once per (precision, checkpointing mode); the fits are cached, so a search over
hundreds of candidates costs a handful of traces.

Why the smallest and the largest micro-batch the search considers as the two traced sizes: within a
segment the peak is the highest of many moments, each linear in the rows, so it is convex in the rows and
a straight line can only be exact where it was measured. Through the two ends of the range the line is
exact there and on the safe side in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memtrain.blocks import discover_blocks, model_shape
from memtrain.errors import Unsupported
from memtrain.footprint import ModelShape
from memtrain.planner.activations import FittedTrace, clone_depth, fit, shallow_config, trace_step
from memtrain.recipe import Recipe
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.precision import Precision


@dataclass
class ModelProbe:
    """A recipe's model as the planner sees it; `progress` receives a line per trace."""

    recipe: Recipe
    progress: Callable[[str], None] = field(default=lambda _line: None)
    shape: ModelShape = field(init=False)
    dim0: dict[str, int] = field(init=False)
    buffer_bytes: int = field(init=False)
    hidden_size: int = field(init=False)
    _config: Any = field(init=False)
    _fits: dict[tuple[str, str, tuple[int, int], bool], FittedTrace] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        from memtrain.models import build_config

        self._config = build_config(self.recipe)
        with torch.device("meta"):
            model = self._build(self._config)
        self.shape = model_shape(model, discover_blocks(model))
        self.dim0 = {name: p.shape[0] if p.dim() else 1 for name, p in model.named_parameters()}
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self.hidden_size = int(getattr(self._config, "hidden_size", 0) or 0)

    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    @property
    def seq_len(self) -> int:
        return self.recipe.data.seq_len

    def trace(self, precision: str, mode: str, rows: tuple[int, int], bf16_weights: bool = False) -> FittedTrace:
        """The activation fit for one precision and one traced checkpointing mode, drawn through traces at
        the smallest and the largest micro-batch rows the search considers (cached). `bf16_weights`: the
        sharding backend hands the forward bf16 weights (FSDP2's and DeepSpeed's bf16-mixed)."""
        if rows[0] == rows[1]:
            rows = (rows[0], 2 * rows[0])
        key = (precision, mode, rows, bf16_weights)
        if key not in self._fits:
            depth = clone_depth(self.num_blocks)
            weights = ", bf16 weights" if bf16_weights else ""
            self.progress(f"tracing {precision}{weights} / checkpointing {mode} ({depth} of {self.num_blocks} "
                          f"blocks, {rows[0]} and {rows[1]} x {self.seq_len} tokens)")
            config = shallow_config(self._config, depth)
            strategy = Precision(precision, fp8_emulate=precision == "fp8")
            try:
                with _one_sequence_per_row():
                    small, large = (
                        trace_step(lambda: self._build(config), discover_blocks, self._batch, _causal_lm_loss,
                                   strategy, Checkpointing(mode), count,
                                   torch.bfloat16 if bf16_weights else None)
                        for count in rows
                    )
                self._fits[key] = fit(small, large)
            except Exception as exc:  # a model or kernel the fake-tensor trace cannot run
                raise Unsupported(f"cannot trace {precision} with checkpointing {mode}: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
        return self._fits[key]

    def _build(self, config: Any) -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config, attn_implementation=self.recipe.model.attn_implementation)

    def _batch(self, rows: int) -> dict[str, torch.Tensor]:
        vocab = int(self._config.vocab_size)
        ids = torch.randint(0, vocab, (rows, self.seq_len))
        return {"input_ids": ids, "labels": torch.randint(0, vocab, (rows, self.seq_len))}


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    """What transformers finds on real tensors, told to it under fake ones.

    The trainer passes neither position ids nor a padding mask, so every row is one sequence and
    transformers' SDPA path relies on `is_causal` without building a mask. To find that out it reads the
    position ids (`masking_utils.find_packed_sequence_indices`); a fake tensor cannot be read, so it assumes
    packed sequences, builds a B x 1 x s x s mask and selects another attention kernel, which keeps other
    tensors for backward. During the trace the lookup answers what it answers on real tensors: no packing.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    from memtrain.models import CausalLMTrainer

    return CausalLMTrainer.loss(None, model, batch)  # type: ignore[arg-type]  # self is unused
