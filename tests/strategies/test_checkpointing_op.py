"""`selective-op`, torchtitan's op-level selective checkpointing: exact numerics, which matmuls it
recomputes (counted in FLOPs against the projections' shapes), and where its bytes fall between the modes.

The models and the peak meter are test_checkpointing.py's: a tiny transformers llama (bias-free linears:
`aten.mm`, the CPU flash SDPA kernel) and a hand-written transformer whose linears have biases (`addmm`,
not on torchtitan's save list) and whose attention is bmm and softmax by hand (no SDPA kernel).
"""

from __future__ import annotations

import pytest
import torch
from test_checkpointing import MODELS, flops, measured_peak, tiny_llama, train

from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.checkpointing import CHECKPOINTING

OP = CHECKPOINTING.create("selective-op")


@pytest.mark.parametrize("name", MODELS)
def test_selective_op_is_bit_identical_to_none(name: str) -> None:
    ref_losses, ref_grads = train(name, CHECKPOINTING.create("none"))
    losses, grads = train(name, OP)
    for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
        assert torch.equal(a, b), f"loss differs at step {step}"
    for step, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)), f"grads differ, step {step}"


def test_llama_recomputes_k_o_and_up_projections_only() -> None:
    """A llama block runs seven `mm`s (q, k, v, o, gate, up, down): the second, fourth and sixth are
    recomputed in backward, once each; attention (the CPU flash kernel) is kept. The extra FLOPs over
    `none` are exactly those three projections' forward (2 FLOPs per weight per token) in every block."""
    model = tiny_llama()
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    hidden, kv = config.hidden_size, config.num_key_value_heads * head_dim
    weights = hidden * kv + hidden * hidden + hidden * config.intermediate_size  # k, o, up
    tokens = 4 * 32  # test_checkpointing.ids_for
    extra = flops("llama", OP) - flops("llama", CHECKPOINTING.create("none"))
    assert extra == config.num_hidden_layers * 2 * tokens * weights
    assert (
        flops("llama", CHECKPOINTING.create("selective"))
        < flops("llama", OP)
        < flops("llama", CHECKPOINTING.create("full"))
    )


def test_biased_linears_and_hand_written_attention_are_recomputed_whole() -> None:
    """torchtitan's list names `aten.mm`, not `addmm` (a linear with a bias) nor bmm: on such a block the
    policy keeps nothing and recomputes as much as `full` does."""
    assert flops("plain", OP) == flops("plain", CHECKPOINTING.create("full"))


def test_selective_op_keeps_less_than_selective_and_more_than_full() -> None:
    """Peak activation bytes of a 12-block llama (hidden 128, 4 x 128 tokens) with each mode."""
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    peaks = {}
    for mode in ("full", "selective-op", "selective"):
        torch.manual_seed(0)
        model = tiny_llama(layers=12, hidden=128, positions=128)
        CHECKPOINTING.create(mode).apply(model, discover_blocks(model))
        peaks[mode] = measured_peak(model, ids)
    assert peaks["full"] < peaks["selective-op"] < peaks["selective"], peaks
