"""Attention and dropout in the activation trace of a CUDA target keep what the CUDA kernels keep for
backward.

The expected bytes come from the kernels' meta implementations called here on meta tensors (output,
log-sum-exp and RNG state), not from the trace; the trace runs them through `traced_attention`. Dropout
masks are counted from the model's shapes: one bool byte per element on CUDA (`traced_dropout`).
Model-level tests share one probe per model (the `probes` fixture), so each fit is traced once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memtrain.memory import MemoryTracker, fake_tensors
from memtrain.memory.headroom import DEFAULT_COMPUTE_CAPABILITY, load_gpu, what_if_target
from memtrain.planner.activations import FittedTrace, SegmentKey
from memtrain.planner.attention_kernels import EAGER, SdpaCall, choose_kernel, traced_attention
from memtrain.planner.cuda_dropout import traced_dropout
from memtrain.planner.explain import describe, to_json
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.search import search
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.precision import BF16Mixed, Precision

from helpers import TINY_LLAMA, probe_of, tiny_recipe
from planner_cases import cpu_target, planner_recipe

SEQ, ROWS = 32, (2, 4)
ACTIVATIONS = 3
SM89 = (8, 9)  # rtx4090-24gb
GPT2 = {
    "model_type": "gpt2",
    "n_embd": 64,
    "n_layer": 3,
    "n_head": 4,
    "n_positions": 64,
    "vocab_size": 256,
    **{f"{part}_pdrop": 0.0 for part in ("attn", "resid", "embd")},  # each test turns on its own
}
LLAMA = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256, "num_hidden_layers": 3}
DROPOUT_KEY = {"gpt2": "attn_pdrop", "llama": "attention_dropout"}
MODELS = {"gpt2": GPT2, "llama": LLAMA}


def call(**fields: Any) -> SdpaCall:
    base: dict[str, Any] = {
        "dtype": torch.bfloat16,
        "head_dim": 64,
        "value_dim": 64,
        "q_len": 1024,
        "kv_len": 1024,
        "heads": 12,
        "kv_heads": 12,
        "has_mask": False,
        "dropout": 0.1,
        "is_causal": True,
        "requires_grad": True,
    }
    fields = {**base, **fields}
    return SdpaCall(**{"key_dim": fields["head_dim"], **fields})


@pytest.mark.parametrize(
    ("fields", "capability", "kernel"),
    [
        ({}, (8, 0), "flash"),  # bf16 on sm80: flash
        ({}, SM89, "flash"),
        ({"dtype": torch.float32}, SM89, "efficient"),  # flash is fp16/bf16 only
        ({"dtype": torch.bfloat16}, (7, 5), "math"),  # bf16 needs sm80 for flash and memory-efficient
        ({"dtype": torch.float16}, (7, 5), "efficient"),  # no flash below sm80
        ({"has_mask": True, "is_causal": False}, (9, 0), "efficient"),  # flash takes no attn_mask
        ({"head_dim": 288, "value_dim": 288}, (9, 0), "efficient"),  # flash: head dim <= 256
        ({"head_dim": 200, "value_dim": 200}, SM89, "efficient"),  # sm86-89 training, head dim (192, 224]
        ({"head_dim": 200, "value_dim": 200}, (9, 0), "flash"),
        ({"head_dim": 240, "value_dim": 240, "dropout": 0.0}, SM89, "flash"),  # (224, 256] without dropout
        ({"head_dim": 240, "value_dim": 240}, SM89, "efficient"),
        ({"q_len": 1, "kv_len": 8}, (9, 0), "efficient"),  # causal flash needs square lengths
        ({"kv_heads": 4}, (9, 0), "math"),  # grouped-query heads without enable_gqa
        ({"kv_heads": 4, "enable_gqa": True}, (9, 0), "flash"),
        ({"kv_heads": 4, "enable_gqa": True, "dtype": torch.float32}, (9, 0), "math"),  # no grouped heads
        ({"head_dim": 30, "value_dim": 30, "dtype": torch.float32}, SM89, "math"),  # not a multiple of 4
        ({"head_dim": 64, "key_dim": 64, "value_dim": 128}, (9, 0), "efficient"),  # flash: one head dim
        ({"head_dim": 64, "key_dim": 128, "value_dim": 64}, (9, 0), "math"),  # q and k must agree
        ({}, (13, 0), "math"),  # past sm121: neither fused kernel's range
    ],
)
def test_kernel_choice_follows_torch_rules(
    fields: dict[str, Any], capability: tuple[int, int], kernel: str
) -> None:
    assert choose_kernel(call(**fields), capability) == kernel


def meta_saved_bytes(kernel: str, shape: tuple[int, ...], dtype: torch.dtype) -> dict[str, int]:
    """What the CUDA kernel's backward node keeps (q, k, v and the kernel's outputs for backward), by
    name, from the kernel's meta implementation with dropout 0.1."""
    q, k, v = (torch.empty(shape, dtype=dtype, device="meta") for _ in range(3))
    if kernel == "flash":
        out, lse, _, _, _, _, rng_state, unused, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.1, True
        )
        kept = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "rng_state": rng_state, "unused": unused}
    else:
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.1, True
        )
        kept = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "seed": seed, "offset": offset}
    return {name: t.numel() * t.element_size() for name, t in kept.items()}


def traced_kept_bytes(capability: tuple[int, int] | None, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Activation bytes alive after a causal SDPA with dropout 0.1 in the trace's own machinery (fake
    tensors, the memory tracker); q, k and v are created in the forward and held only by autograd."""
    with fake_tensors():
        leaves = torch.empty((3, *shape), dtype=dtype, requires_grad=True)
        tracker = MemoryTracker(None, device="meta")  # where fake tensors keep their storages
        with tracker, traced_attention(capability):
            with tracker.phase("forward"):
                q, k, v = (leaves[i] * 1.0 for i in range(3))
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
                del q, k, v
            kept = tracker.snapshot()["activations"]
            with tracker.phase("backward"):
                out.float().sum().backward()
        assert leaves.grad is not None and leaves.grad.shape == leaves.shape
    return kept


@pytest.mark.parametrize(
    ("dtype", "kernel", "head_dim", "kernel_head_dim"),
    [
        (torch.bfloat16, "flash", 16, 16),
        (
            torch.bfloat16,
            "flash",
            20,
            24,
        ),  # torch pads q, k, v to a multiple of 8 for flash: it keeps the copies
        (torch.float32, "efficient", 16, 16),
    ],
)
def test_cuda_sdpa_keeps_what_the_kernel_keeps(
    dtype: torch.dtype, kernel: str, head_dim: int, kernel_head_dim: int
) -> None:
    shape = (2, 4, 48, head_dim)  # 48 tokens: the memory-efficient log-sum-exp is padded to 64
    expected = sum(meta_saved_bytes(kernel, (*shape[:3], kernel_head_dim), dtype).values())
    assert traced_kept_bytes(SM89, shape, dtype) == expected
    assert traced_kept_bytes(None, shape, dtype) > expected  # the CPU math path keeps the probabilities


def test_real_tensors_run_the_cpu_kernel() -> None:
    """A trace rerun on real tensors (model_probe's fallback) has no CUDA kernel to run: the CPU's runs."""
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    with traced_attention(SM89) as log:
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
    out.sum().backward()
    assert log.describe() == "CPU SDPA"
    assert q.grad is not None and q.grad.shape == q.shape


def traced_dropout_kept(capability: tuple[int, int] | None, dtype: torch.dtype) -> tuple[int, str]:
    """Activation bytes alive after an `nn.Dropout(0.1)` of a 4 x 1000 input made in the forward, and the
    output's backward node, in the trace's machinery (fake tensors, the memory tracker)."""
    with fake_tensors():
        leaf = torch.empty(4, 1000, dtype=dtype, requires_grad=True)
        tracker = MemoryTracker(None, device="meta")
        with tracker, traced_dropout(capability):
            with tracker.phase("forward"):
                x = leaf * 1.0
                out = nn.Dropout(0.1)(x)
                del x
            kept = tracker.snapshot()["activations"]
            with tracker.phase("backward"):
                out.float().sum().backward()
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    return kept, type(out.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dropout_keeps_a_bool_mask(dtype: torch.dtype) -> None:
    """The output (still referenced) plus what backward keeps: a 1-byte bool mask per element on CUDA (the
    fused `native_dropout`), a noise tensor of the input's dtype on the CPU."""
    elements, size = 4000, torch.empty((), dtype=dtype).element_size()
    assert traced_dropout_kept(SM89, dtype) == (elements * size + elements, "NativeDropoutBackward0")
    assert traced_dropout_kept(None, dtype) == (2 * elements * size, "MulBackward0")


def test_cuda_dropout_leaves_what_cuda_does_not_fuse() -> None:
    """Evaluation and p = 0 return the input, p = 1 and in-place dropout take the unfused route (as in
    torch's Dropout.cpp on CUDA); F.dropout is restored on exit."""
    original = F.dropout
    x = torch.randn(3, 5, requires_grad=True)
    with traced_dropout(SM89):
        assert F.dropout(x, 0.1, training=False) is x
        assert F.dropout(x, 0.0) is x
        assert type(F.dropout(x, 1.0).grad_fn).__name__ == "MulBackward0"
        assert type(F.dropout(x * 1.0, 0.1, inplace=True).grad_fn).__name__ == "MulBackward0"
        assert type(F.dropout(x, 0.1).grad_fn).__name__ == "NativeDropoutBackward0"  # real tensors too
    assert F.dropout is original


Probes = Callable[..., ModelProbe]


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> Probes:
    """`probes(name, attention="sdpa", **config_fields)`: one probe per model for the whole module, so
    tests that trace the same model, precision and target share the probe's cached fit."""
    made: dict[tuple[Any, ...], ModelProbe] = {}

    def probe(name: str, attention: str = "sdpa", **config_fields: float) -> ModelProbe:
        key = (name, attention, tuple(sorted(config_fields.items())))
        if key not in made:
            config = {**MODELS[name], **config_fields}
            data = {"seq_len": SEQ, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}}
            model = {"config": config, "attn_implementation": attention}
            made[key] = probe_of(tiny_recipe(tmp_path_factory.mktemp(name), model=model, data=data))
        return made[key]

    return probe


def kept(
    probe: ModelProbe, precision: Precision, capability: tuple[int, int] | None, phase: str = "fwd.block"
) -> float:
    """Activation bytes a forward segment (block 1, or the embedding before the blocks) adds at
    ROWS[0] rows."""
    fitted: FittedTrace = probe.trace(precision, NoCheckpointing(), ROWS, None, None, capability)
    key = SegmentKey("first", phase, 1 if phase == "fwd.block" else -1)
    return fitted.at(key, ROWS[0] * SEQ).end[ACTIVATIONS]


@pytest.mark.parametrize(
    ("name", "heads", "precision", "kernel"),
    [
        ("gpt2", {}, BF16Mixed(), "flash"),
        ("llama", {}, BF16Mixed(), "flash"),  # grouped-query heads: flash takes them
        ("llama", {"num_key_value_heads": 4}, Precision(), "efficient"),  # memory-efficient does not
    ],
)
def test_trace_with_attention_dropout_keeps_the_cuda_kernels_tensors(
    probes: Probes, one_thread: None, name: str, heads: dict[str, int], precision: Precision, kernel: str
) -> None:
    """Each block keeps what it keeps on the CPU without dropout (the CPU flash kernel: q, k, v, output and
    an fp32 log-sum-exp) plus the CUDA kernel's RNG state, whatever the dropout (the CPU math path's
    probabilities and mask: test_cuda_sdpa_keeps_what_the_kernel_keeps)."""
    dropped, plain = probes(name, **heads, **{DROPOUT_KEY[name]: 0.1}), probes(name, **heads)
    saved = meta_saved_bytes(
        kernel, (ROWS[0], 4, SEQ, 16), torch.bfloat16 if kernel == "flash" else torch.float32
    )
    rng_state = sum(v for k, v in saved.items() if k in ("rng_state", "unused", "seed", "offset"))
    assert kept(dropped, precision, SM89) == kept(plain, precision, None) + rng_state
    fitted = dropped.trace(precision, NoCheckpointing(), ROWS, None, None, SM89)
    assert kernel.replace("efficient", "memory-efficient") in fitted.attention


def test_gpt2_dropout_masks_are_one_bool_byte_per_element_on_cuda(probes: Probes, one_thread: None) -> None:
    """GPT-2's residual dropouts (after attention and after the MLP, two per block) and its embedding
    dropout: on CUDA each keeps a bool mask of the hidden states (B x S x n_embd, 1 byte each); the CPU
    trace keeps a noise tensor of the input's dtype (bf16 projections, the fp32 embedding sum)."""
    dropped, plain = probes("gpt2", resid_pdrop=0.1, embd_pdrop=0.1), probes("gpt2")
    hidden = ROWS[0] * SEQ * GPT2["n_embd"]
    for capability, block_bytes, embedding_bytes in ((SM89, 1, 1), (None, 2, 4)):
        assert kept(dropped, BF16Mixed(), capability) - kept(plain, BF16Mixed(), capability) == (
            2 * hidden * block_bytes
        )
        masks = kept(dropped, BF16Mixed(), capability, "fwd.pre") - kept(
            plain, BF16Mixed(), capability, "fwd.pre"
        )
        assert masks == hidden * embedding_bytes


def test_eager_attention_dropout_keeps_a_bool_mask_on_cuda(probes: Probes, one_thread: None) -> None:
    """Eager attention never calls SDPA: it drops the fp32 probabilities (B x H x S x S) with
    `nn.functional.dropout`, whose mask is 1 byte per element on CUDA and 4 (an fp32 noise) on the CPU."""
    probe = probes("llama", attention="eager", attention_dropout=0.1)
    probabilities = ROWS[0] * LLAMA["num_attention_heads"] * SEQ * SEQ
    assert kept(probe, Precision(), SM89) == kept(probe, Precision(), None) - 3 * probabilities
    assert probe.trace(Precision(), NoCheckpointing(), ROWS, None, None, SM89).attention == EAGER


def test_what_if_targets_carry_the_compute_capability() -> None:
    assert what_if_target(1, load_gpu("rtx4090-24gb"), None, None).compute_capability == SM89
    assert what_if_target(1, None, 24 * 2**30, None).compute_capability == DEFAULT_COMPUTE_CAPABILITY


def test_plan_names_the_attention_kernel(tmp_path: Path, one_thread: None) -> None:
    config = {**LLAMA, "attention_dropout": 0.1}
    recipe = planner_recipe(
        tmp_path,
        model={"config": config},
        strategies={"precision": "bf16-mixed", "checkpointing": "none", "optimizer_states": "fp32"},
    )
    probe = probe_of(recipe)
    gpu = search(
        recipe, probe, what_if_target(1, load_gpu("rtx4090-24gb"), None, None), torch.device("cuda", 0)
    )
    flash = "CUDA flash SDPA (output, log-sum-exp and RNG state kept for backward)"
    assert gpu.attention == flash
    assert f"attention in the trace: {flash}" in describe(gpu, "plan")
    assert to_json(gpu)["attention"] == flash
    here = search(recipe, probe, cpu_target(), torch.device("cpu"))
    assert here.attention == "CPU SDPA"
    assert gpu.predicted is not None and here.predicted is not None
    assert gpu.predicted.activations < here.predicted.activations
