"""The loss strategy: `chunked` and `fused` compute what `standard` computes (loss and gradients), keep a
fraction of its memory at a large vocabulary, and are refused for models whose logits are not
`head(hidden)`."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtrain.causal_lm.trainer import CausalLMTrainer, check_bare_head_loss
from memtrain.errors import Unsupported
from memtrain.memory import MemoryTracker
from memtrain.plan import Plan
from memtrain.strategies.apply import apply_strategies
from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.loss import Chunked, Fused, Loss, bound_loss
from memtrain.strategies.precision import BF16Mixed, Precision

from helpers import TINY_LLAMA, tiny_recipe

TINY_GPT2 = {
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "vocab_size": 96,
}


def _model(config: dict[str, Any], loss: Loss, precision: Precision | None = None) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    apply_strategies(model, discover_blocks(model), precision or Precision(), NoCheckpointing(), loss=loss)
    return model


def _step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    binding = bound_loss(model)
    with binding.deferring_head():
        output = model(input_ids=ids, use_cache=False).logits
    loss = binding(output, labels, -100)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _batch(vocab: int, rows: int = 3, seq: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels[0, :5] = -100  # prompt tokens without loss
    labels[2, -3:] = -100  # padding
    return ids, labels


@pytest.mark.parametrize("kind", [Chunked, Fused])
@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GPT2], ids=["llama", "gpt2-tied"])
def test_chunked_and_fused_equal_standard_fp32(config: dict[str, Any], kind: type[Chunked]) -> None:
    ids, labels = _batch(config["vocab_size"])
    loss, grads = _step(_model(config, Loss()), ids, labels)
    chunked_loss, chunked_grads = _step(_model(config, kind(chunk_tokens=7)), ids, labels)  # 39 tokens
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == chunked_grads.keys()
    for name, grad in grads.items():
        # the chunks sum the logits' gradients into the head (tied: the embedding) and on down in another
        # order: fp32 rounding of sums whose terms reach the tensor's largest entries, a few ulps of those
        # (measured on this machine's CPU: 2.9e-6 on a bias whose gradient reaches 8.5, 3 ulps)
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-6, atol=1e-6 * scale, msg=name)


@pytest.mark.parametrize("kind", [Chunked, Fused])
def test_chunked_and_fused_equal_standard_bf16_autocast(kind: type[Chunked]) -> None:
    ids, labels = _batch(TINY_LLAMA["vocab_size"])
    results = []
    for loss in (Loss(), kind(chunk_tokens=5)):
        model = _model(TINY_LLAMA, loss, BF16Mixed())
        with BF16Mixed().autocast(torch.device("cpu")):
            results.append(_step(model, ids, labels))
    (loss, grads), (chunked_loss, chunked_grads) = results
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():  # bf16 matmuls over other partial sums: bf16 resolution, as a norm
        assert (chunked_grads[name] - grad).norm() <= 1e-2 * grad.norm(), name


def _step_peak(loss: Loss, read_loss: bool = True) -> int:
    """The tracked peak of forward + backward of a 64-wide, 32768-token llama on 4 x 256 tokens; without
    `read_loss`, of a loss that reads the hidden states only (the decoder's own share)."""
    config = {**TINY_LLAMA, "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 32768}
    config.update(max_position_embeddings=256, tie_word_embeddings=True)
    ids, labels = _batch(32768, rows=4, seq=256)
    model = _model(config, loss)
    binding = bound_loss(model)
    tracker = MemoryTracker(model)
    with tracker:
        tracker.begin_step(0)
        with tracker.phase("forward"), binding.deferring_head():
            output = model(input_ids=ids, use_cache=False).logits
        value = binding(output, labels, -100) if read_loss else output.float().sum()
        with tracker.phase("backward"):
            value.backward()
        del output, value
        return tracker.end_step().peak_bytes


@pytest.mark.parametrize("kind", [Chunked, Fused])
def test_chunked_and_fused_cut_the_loss_memory_by_80_percent_at_a_32k_vocabulary(kind: type[Chunked]) -> None:
    decoder = _step_peak(kind(), read_loss=False)
    standard = _step_peak(Loss()) - decoder
    cut = _step_peak(kind(chunk_tokens=128)) - decoder
    print(f"loss memory: standard {standard:,} B, {kind.name}(128) {cut:,} B")
    assert cut <= 0.2 * standard, (standard, cut)


def test_softcapping_family_is_refused_for_chunked_and_fused() -> None:
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma2", final_logit_softcapping=30.0)
    for name in ("chunked", "fused"):
        with pytest.raises(Unsupported, match=f"loss: {name} .*final_logit_softcapping"):
            check_bare_head_loss(config, name)
    check_bare_head_loss(AutoConfig.for_model("llama"), "fused")  # a plain head: nothing to refuse


def test_pinned_chunked_and_fused_train_like_standard(tmp_path: Path) -> None:
    """Through the real trainer: the losses of three steps agree, and the plan records the loss."""
    losses = []
    for name in ("standard", "chunked", "fused"):
        recipe = tiny_recipe(
            tmp_path / name, train={"steps": 3}, strategies={"loss": name, "loss_chunk_tokens": 24}
        )
        trainer = CausalLMTrainer(recipe)
        result = trainer.fit()
        assert trainer.plan.loss.name == name
        losses.append(result.losses)
    for other in losses[1:]:
        torch.testing.assert_close(torch.tensor(other), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)


def test_plan_json_without_a_loss_still_loads() -> None:
    plan = Plan.from_dict(
        {
            "precision": {"name": "fp32"},
            "checkpointing": {"name": "none"},
            "optimizer_states": {"name": "fp32"},
            "sharding": {"name": "none"},
            "micro_batching": {"name": "sequences", "size": 2, "accumulation_steps": 1},
            "world_size": 1,
        }
    )
    assert plan.loss == Loss()
    assert Plan.from_dict(plan.replace(loss=Chunked(256)).to_dict()).loss == Chunked(256)


def _fused_head_step(fake: bool) -> Any:
    """The tracker's report of the fused loss alone, forward + backward, as Liger's benchmark runs its kernel:
    a bias-free head over 256 tokens of width 64 at a 8192 vocabulary (a 2 MiB fp32 weight, 16-token chunks
    of 512 KiB logits), the loss divided by the tokens (an upstream gradient of 1/256, not 1); under fake
    tensors when `fake` (what the planner's trace counts)."""
    from memtrain.memory import fake_tensors
    from memtrain.strategies.fused_cross_entropy import fused_linear_cross_entropy

    tokens, width, vocab = 256, 64, 8192
    with fake_tensors() if fake else contextlib.nullcontext():
        head = nn.Linear(width, vocab, bias=False)
        hidden = torch.randn(tokens, width, requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,))
        tracker = MemoryTracker(head)
        with tracker:
            tracker.begin_step(0)
            with tracker.phase("forward"):
                loss = fused_linear_cross_entropy(hidden, head.weight, None, labels, -100, 16) / tokens
            with tracker.phase("backward"):
                loss.backward()
            del loss
            return tracker.end_step()


def test_fused_holds_one_head_gradient_and_backward_allocates_none() -> None:
    """Forward accumulates the head's gradient in place (no head-sized product per chunk) and backward hands
    on the kept gradients scaled in place (no copy): the forward's activations at the peak are that one
    head-sized gradient and a chunk's logits, and backward ends holding what it held at its peak (the kept
    gradients became `.grad`). The hole (Liger's benchmark at a 128k vocabulary: +1 GiB over its kernel, the
    head's bf16 gradient): a head-sized product per chunk in forward and `grad * scale` copies in backward,
    here 2 MiB more at each. The planner's fake-tensor trace of the same step counts the same bytes."""
    head_bytes, chunk_logits_bytes = 8192 * 64 * 4, 16 * 8192 * 4
    real = _fused_head_step(fake=False)
    assert real.peak_phase == "forward"
    assert real.at_peak["activations"] < head_bytes + 2 * chunk_logits_bytes, real.at_peak
    assert real.phase_peaks["backward"] - real.live_bytes_end < chunk_logits_bytes, real
    assert _fused_head_step(fake=True).peak_bytes == real.peak_bytes


def test_liger_benchmark_replayed_as_a_what_if() -> None:
    """Liger-Kernel's own memory benchmark of its fused linear cross-entropy (hidden 4096, vocabulary 128,256,
    bf16, 4,096 tokens, forward + backward, `max_memory_allocated`, H100): 6,092 MiB for torch's linear +
    cross-entropy, 4,246 MiB for its kernel. memtrain's prediction (scripts/bench_loss.py `liger_whatif`) of the
    torch baseline and of its own fused loss at the chunk Liger's kernel picks there (128 tokens): within 2%
    of each (measured: -0.3% and -1.1%). The hole: the fused loss was predicted 22.5% over (5,200 MiB), the
    head's 1002 MiB bf16 gradient held twice."""
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("bench_loss", REPO / "scripts" / "bench_loss.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    published = bench.LIGER_PUBLISHED_MIB[4096]
    torch_mib = bench.liger_whatif(4096, "torch") / 2**20
    fused_mib = bench.liger_whatif(4096, "fused", chunk_tokens=128) / 2**20
    assert abs(torch_mib / published["torch"] - 1) < 0.02, torch_mib
    assert abs(fused_mib / published["liger"] - 1) < 0.02, fused_mib
