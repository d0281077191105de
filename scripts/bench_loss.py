"""Loss memory and step time of `strategies.loss` standard vs chunked vs fused, side by side.

A one-block, 64-wide llama with tied embeddings on 4 x 256 tokens, at each vocabulary size. The loss memory
is the tracker's step peak (forward + backward) minus that of a loss that reads the hidden states only;
the step time is the best of 3 forward + backward passes. On CUDA (`--device cuda`) `fused` runs
Liger-Kernel's kernel when it is installed (else the same algorithm in PyTorch; the table says which).

    .venv/bin/python scripts/bench_loss.py [--vocab 32768 131072] [--chunk 128] [--device cuda]
        [--json OUT.json] [--markdown OUT.md]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from memtrain.memory import MemoryTracker
from memtrain.strategies.apply import apply_strategies
from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.fused_cross_entropy import liger_available
from memtrain.strategies.loss import Chunked, Fused, Loss, bound_loss
from memtrain.strategies.precision import Precision

ROWS, SEQ, HIDDEN = 4, 256, 64


def _model(vocab: int, loss: Loss, device: torch.device) -> torch.nn.Module:
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
    model = AutoModelForCausalLM.from_config(config).to(device)
    apply_strategies(model, discover_blocks(model), Precision(), NoCheckpointing(), loss=loss)
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, read_loss: bool) -> None:
    binding = bound_loss(model)
    with binding.deferring_head():
        output = model(input_ids=ids, use_cache=False).logits
    value = binding(output, labels, -100) if read_loss else output.float().sum()
    value.backward()


def measure(vocab: int, loss: Loss, device: torch.device) -> tuple[int, float]:
    """(peak bytes of one tracked step, best seconds of 3 untracked steps)."""
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    model = _model(vocab, loss, device)
    read_loss = not isinstance(loss, _HiddenOnly)
    tracker = MemoryTracker(model)
    with tracker:
        tracker.begin_step(0)
        _step(model, ids, ids, read_loss)
        peak = tracker.end_step().peak_bytes
    times = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        _sync(device)
        start = time.perf_counter()
        _step(model, ids, ids, read_loss)
        _sync(device)
        times.append(time.perf_counter() - start)
    return peak, min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HiddenOnly(Chunked):
    """The decoder's share: the hidden states without a loss over the head."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunk", type=int, default=128)  # 1/8 of the tokens, as 1024 of 8192
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    fused_kernel = "liger" if liger_available(device) else "pytorch"
    losses = {"standard": Loss(), "chunked": Chunked(chunk_tokens=args.chunk), "fused": Fused(args.chunk)}
    results = []
    for vocab in args.vocab:
        decoder, _ = measure(vocab, _HiddenOnly(), device)
        row: dict[str, float | int | str] = {
            "vocab": vocab,
            "device": device.type,
            "fused_kernel": fused_kernel,
        }
        for name, loss in losses.items():
            peak, seconds = measure(vocab, loss, device)
            row[f"{name}_loss_bytes"], row[f"{name}_step_s"] = peak - decoder, seconds
        results.append(row)
        print(
            f"vocab {vocab}: loss memory "
            + ", ".join(f"{n} {float(row[f'{n}_loss_bytes']) / 2**20:.1f} MiB" for n in losses)
            + "; step "
            + ", ".join(f"{n} {float(row[f'{n}_step_s']) * 1e3:.0f} ms" for n in losses),
            flush=True,
        )
    table = [
        f"| vocab | device | loss MiB standard / chunked({args.chunk}) / fused ({fused_kernel}) | cut chunked / fused "
        "| step ms standard / chunked / fused |",
        "|---|---|---|---|---|",
    ]
    for row in results:
        mib = [float(row[f"{n}_loss_bytes"]) / 2**20 for n in losses]
        ms = [float(row[f"{n}_step_s"]) * 1e3 for n in losses]
        table.append(
            f"| {row['vocab']} | {device.type} | {mib[0]:.1f} / {mib[1]:.1f} / {mib[2]:.1f} | "
            f"{1 - mib[1] / mib[0]:.0%} / {1 - mib[2] / mib[0]:.0%} | {ms[0]:.0f} / {ms[1]:.0f} / {ms[2]:.0f} |"
        )
    print("\nfor docs/BENCHMARKS.md:\n" + "\n".join(table))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.markdown:
        args.markdown.write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
