"""Byte arithmetic shared by every strategy's `estimate`: the value types, no torch calls.

A `Footprint` is the predicted peak memory of one rank broken down as memtrain reports everything:
weights, gradients, optimizer states, activations, other. Strategies take the model's shape
(`ModelShape`: the size of every parameter tensor, and which block holds it) and the activation
profile measured by a trace (`ActivationProfile`), and each one adds or rescales the components it
changes. Because these are plain integers, each estimate can be checked by hand in a unit test.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

COMPONENTS = ("weights", "gradients", "optimizer_states", "activations", "other")


@dataclass(frozen=True)
class Footprint:
    weights: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    other: int = 0

    @property
    def peak(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations + self.other

    def with_(self, **changes: int) -> Footprint:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in COMPONENTS} | {"peak": self.peak}


@dataclass(frozen=True)
class ParamInfo:
    name: str
    numel: int
    block: int | None  # index of the transformer block holding it; None for embeddings, head, norms
    trainable: bool = True  # requires_grad: only trainable parameters get gradients and optimizer states
    dims: tuple[int, ...] = ()  # the tensor's shape; () when unknown (then taken as one dimension of numel)


@dataclass(frozen=True)
class ModelShape:
    params: tuple[ParamInfo, ...]
    num_blocks: int

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def trainable(self) -> ModelShape:
        """The shape of the trainable parameters alone (what gradients and optimizer states cover)."""
        return ModelShape(tuple(p for p in self.params if p.trainable), self.num_blocks)

    def block_numel(self, block: int) -> int:
        return sum(p.numel for p in self.params if p.block == block)

    @property
    def largest_block_numel(self) -> int:
        return max((self.block_numel(b) for b in range(self.num_blocks)), default=0)


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes of one micro-batch, measured by a trace without checkpointing
    (`memtrain.memory.activation_profile.profile_activations`).

    per_block: bytes autograd keeps for each block. block_inputs: bytes of each block's input (what full
    checkpointing keeps instead). matmul_outputs: every matmul output of each block, saved or not (what
    selective checkpointing keeps). outside_blocks: what the head side holds at its peak (embeddings,
    final norm, head, loss, including the logits the loss reads). block_peaks: the most bytes each
    block's forward had alive at once (saved tensors and intermediates its code still held).
    recompute_peaks: the same up to the block's last saved tensor (what a recompute re-creates). When
    the last two are empty, `per_block - block_inputs` stands in for both.
    """

    per_block: tuple[int, ...]
    block_inputs: tuple[int, ...]
    matmul_outputs: tuple[int, ...] = field(default=())
    outside_blocks: int = 0
    block_peaks: tuple[int, ...] = field(default=())
    recompute_peaks: tuple[int, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(self.per_block) + self.outside_blocks
