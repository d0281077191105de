"""Loss memory and step time of `strategies.loss` standard vs chunked, side by side (CPU).

A one-block, 64-wide llama with tied embeddings on 4 x 256 tokens, at each vocabulary size. The loss memory
is the tracker's step peak (forward + backward) minus that of a loss that reads the hidden states only;
the step time is the best of 3 forward + backward passes.

    .venv/bin/python scripts/bench_loss.py [--vocab 32768 131072] [--chunk 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from memtrain.memory import MemoryTracker
from memtrain.strategies.apply import apply_strategies
from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.loss import Chunked, Loss, bound_loss
from memtrain.strategies.precision import Precision

ROWS, SEQ, HIDDEN = 4, 256, 64


def _model(vocab: int, loss: Loss) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    apply_strategies(model, discover_blocks(model), Precision(), NoCheckpointing(), loss=loss)
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, read_loss: bool) -> None:
    binding = bound_loss(model)
    with binding.deferring_head():
        output = model(input_ids=ids, use_cache=False).logits
    value = binding(output, labels, -100) if read_loss else output.float().sum()
    value.backward()


def measure(vocab: int, loss: Loss) -> tuple[int, float]:
    """(peak bytes of one tracked step, best seconds of 3 untracked steps)."""
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    model = _model(vocab, loss)
    tracker = MemoryTracker(model)
    with tracker:
        tracker.begin_step(0)
        _step(model, ids, ids, read_loss=not isinstance(loss, _HiddenOnly))
        peak = tracker.end_step().peak_bytes
    times = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        _step(model, ids, ids, read_loss=not isinstance(loss, _HiddenOnly))
        times.append(time.perf_counter() - start)
    return peak, min(times)


class _HiddenOnly(Chunked):
    """The decoder's share: the hidden states without a loss over the head."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunk", type=int, default=128)  # 1/8 of the tokens, as 1024 of 8192
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for vocab in args.vocab:
        decoder, _ = measure(vocab, _HiddenOnly())
        (standard, t_standard), (chunked, t_chunked) = (
            measure(vocab, loss) for loss in (Loss(), Chunked(chunk_tokens=args.chunk))
        )
        loss_standard, loss_chunked = standard - decoder, chunked - decoder
        cut = 1 - loss_chunked / loss_standard
        print(
            f"vocab {vocab}: loss memory standard {loss_standard / 2**20:.1f} MiB, chunked({args.chunk}) "
            f"{loss_chunked / 2**20:.1f} MiB ({cut:.0%} less); step standard {t_standard * 1e3:.0f} ms, "
            f"chunked {t_chunked * 1e3:.0f} ms"
        )
        rows.append(
            f"| {vocab} | {loss_standard / 2**20:.1f} | {loss_chunked / 2**20:.1f} | {cut:.0%} | "
            f"{t_standard * 1e3:.0f} | {t_chunked * 1e3:.0f} |"
        )
    print("\nfor docs/BENCHMARKS.md:")
    print("| vocab | loss MiB standard | loss MiB chunked | cut | step ms standard | step ms chunked |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
