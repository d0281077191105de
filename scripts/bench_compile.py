"""Eager against compiled (`strategies.compile`: none, blocks, model) on the CPU: step time and compile time.

A small llama (transformers), fp32 AdamW, checkpointing `none` (or `--checkpointing`), one fixed batch of
`--rows` x `--seq` tokens called without a KV cache as the trainer calls it (with one, each block would
guard on its own cache layer and compile again: one compile per block, eager past Dynamo's recompile limit), the strategies applied by memtrain's own `apply_strategies` (so the compiled
regions are the ones a run compiles). Per variant: the first step (which compiles: its excess over a
steady step is the compile time) and the median of `--steps` later steps; the ratios are against eager.
The later steps run round-robin over the variants (none, blocks, model, none, ...), so that load from
other processes on a shared machine slows every variant alike. Inductor's on-disk caches are off unless
`--warm-cache`, so the compile time is a cold compile's.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python scripts/bench_compile.py [--layers 4] [--hidden 256]
        [--seq 256] [--rows 4] [--steps 10] [--checkpointing none] [--warm-cache]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checkpointing", default="none")
    parser.add_argument("--warm-cache", action="store_true", help="keep Inductor's on-disk caches on")
    return parser.parse_args()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # as the trainer calls it
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


Variant = tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]


def _build(args: argparse.Namespace, name: str) -> Variant:
    """Variant `name`'s model (strategies applied), optimizer and batch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtrain.strategies.apply import apply_strategies
    from memtrain.strategies.blocks import discover_blocks
    from memtrain.strategies.checkpointing import CHECKPOINTING
    from memtrain.strategies.compile import COMPILE
    from memtrain.strategies.precision import PRECISION

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=args.seq,
    )
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    apply_strategies(
        model,
        discover_blocks(model),
        PRECISION.create("fp32"),
        CHECKPOINTING.create(args.checkpointing),
        compile=COMPILE.create(name),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (args.rows, args.seq), generator=torch.Generator().manual_seed(1))
    return model, optimizer, ids


def main() -> None:
    args = _parse()
    if not args.warm_cache:
        from torch._inductor import config as inductor_config

        inductor_config.force_disable_caches = True  # the environment variable is read at import
    threads = torch.get_num_threads()
    print(
        f"llama {args.layers} x {args.hidden}, {args.rows} x {args.seq} tokens, fp32, checkpointing "
        f"{args.checkpointing}, {threads} thread(s), torch {torch.__version__}, median of {args.steps} steps",
        file=sys.stderr,
    )
    variants = {name: _build(args, name) for name in ("none", "blocks", "model")}
    first = {name: _step(*variant) for name, variant in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, variant in variants.items():
            times[name].append(_step(*variant))
    rows = {name: (first[name], statistics.median(times[name])) for name in variants}
    eager = rows["none"][1]
    print("| compile | step (s) | step / eager | first step (s) | compile time (s) |")
    print("|---|---|---|---|---|")
    for name, (once, steady) in rows.items():
        print(
            f"| {name} | {steady:.4f} | {steady / eager:.2f} | {once:.2f} | {max(0.0, once - steady):.1f} |"
        )


if __name__ == "__main__":
    main()
