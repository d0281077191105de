"""Loss memory and step time of `strategies.loss` standard vs chunked vs fused, side by side.

A one-block, 64-wide llama with tied embeddings on 4 x 256 tokens, at each vocabulary size. The loss memory
is the tracker's step peak (forward + backward) minus that of a loss that reads the hidden states only;
the step time is the best of 3 forward + backward passes. On CUDA (`--device cuda`) `fused` runs
Liger-Kernel's kernel when it is installed (else the same algorithm in PyTorch; the table says which).

    .venv/bin/python scripts/bench_loss.py [--vocab 32768 131072] [--chunk 128] [--device cuda]
        [--json OUT.json] [--markdown OUT.md]

`--liger` replays Liger-Kernel's own memory benchmark of its fused linear cross-entropy instead, as a what-if
on a CUDA target (no GPU needed: fake tensors under memtrain's tracker, `liger_whatif`), and prints the
predicted forward + backward peak beside the published one. Liger's setup
(benchmark/scripts/benchmark_fused_linear_cross_entropy.py, `full` mode, memory): hidden 4096, vocabulary
128,256, bf16 everywhere, B x T tokens; both providers' bias-free heads are built (the torch and the Liger
module) and `_test_memory` reports `max_memory_allocated` in MiB, the median of 10 forward + backward passes
that never zero the gradients (from the second pass on, the input's and the head's `.grad` exist and are
accumulated into). The torch provider is `CrossEntropyLoss(linear(x))` on bf16 logits, mean reduction;
memtrain's `fused` runs the PyTorch algorithm the planner traces (the loss summed, divided by the tokens:
an upstream gradient of 1/tokens) at memtrain's default chunk (1024 tokens) and at the chunk Liger's kernel
picks here (128 tokens).

    .venv/bin/python scripts/bench_loss.py --liger [--tokens 4096]
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


LIGER_HIDDEN, LIGER_VOCAB = 4096, 128256
LIGER_PUBLISHED_MIB = {4096: {"torch": 6092.0, "liger": 4246.0}}  # Liger's README / benchmark data, H100


def liger_whatif(tokens: int, loss: str, chunk_tokens: int = 1024) -> int:
    """Predicted peak allocated bytes of Liger's memory benchmark (`full` mode) at `tokens` tokens for `loss`
    (`torch`: linear + cross-entropy; `fused`: memtrain's fused loss at `chunk_tokens`): the tracker's peak of
    the second forward + backward (the first creates the gradients every later one accumulates into; Liger
    reports the median of 10) under fake tensors on the CPU device, as the planner traces a CUDA target (torch's
    CPU build has no CUDA device guard for the autograd engine); the same tensors, each a multiple of CUDA's
    512-byte block, so allocated bytes are the same."""
    import torch.nn.functional as F

    from memtrain.memory import fake_tensors
    from memtrain.strategies.fused_cross_entropy import FusedLinearCrossEntropy

    device = torch.device("cpu")
    with fake_tensors():
        # the benchmark builds both providers' heads; values are not needed (nor drawn: no CUDA generator)
        heads = torch.nn.ParameterDict(
            {
                name: torch.empty(LIGER_VOCAB, LIGER_HIDDEN, dtype=torch.bfloat16, device=device)
                for name in ("torch", "liger")
            }
        )
        hidden = torch.empty(tokens, LIGER_HIDDEN, dtype=torch.bfloat16, device=device, requires_grad=True)
        target = torch.zeros(tokens, dtype=torch.long, device=device)
        weight = heads["torch"]
        tracker = MemoryTracker(heads)  # counts the fake storages (on the meta device)
        peaks = []
        with tracker:
            for step in range(2):
                tracker.begin_step(step)
                if loss == "torch":
                    value = F.cross_entropy(F.linear(hidden, weight), target)
                else:
                    summed = FusedLinearCrossEntropy.apply(hidden, weight, None, target, -100, chunk_tokens)
                    value = summed / tokens
                value.backward()
                del value
                peaks.append(tracker.end_step().peak_bytes)
        return peaks[-1]


def liger_table(tokens: int) -> list[str]:
    """Markdown rows: memtrain's prediction of Liger's benchmark beside the published MiB."""
    published = LIGER_PUBLISHED_MIB.get(tokens, {})
    rows = [
        f"| Liger's benchmark, {tokens} tokens, H {LIGER_HIDDEN}, V {LIGER_VOCAB}, bf16 | predicted MiB | "
        "published MiB | error |",
        "|---|---|---|---|",
    ]
    cases = [
        ("torch linear + cross-entropy", "torch", 1024, "torch"),
        ("memtrain fused, chunk 1024", "fused", 1024, "liger"),
        ("memtrain fused, chunk 128 (Liger's)", "fused", 128, "liger"),
    ]
    for label, loss, chunk, against in cases:
        mib = liger_whatif(tokens, loss, chunk) / 2**20
        ref = published.get(against)
        error = f"{mib / ref - 1:+.1%}" if ref else "-"
        rows.append(f"| {label} | {mib:,.0f} | {f'{ref:,.0f} ({against})' if ref else '-'} | {error} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunk", type=int, default=128)  # 1/8 of the tokens, as 1024 of 8192
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--liger", action="store_true", help="replay Liger-Kernel's benchmark as a what-if")
    parser.add_argument("--tokens", type=int, default=4096, help="B x T of --liger")
    args = parser.parse_args()
    if args.liger:
        print("\n".join(liger_table(args.tokens)))
        return
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
