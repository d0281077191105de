"""Per-rank model-state bytes and step time of every sharding mode on 2 CPU ranks, as a markdown table.

    python scripts/bench_sharding.py [--steps 8] [--json out.json]

It launches itself under torchrun (2 gloo ranks), trains a small llama (4 layers, hidden 256,
vocabulary 2048; 3.7M parameters) for a few steps in every mode, and prints for each: the bytes this
rank measurably holds (`census`: weights, gradients, optimizer states, DDP buckets,
weights gathered at the end of forward, max over ranks), memtrain's estimate of the peak (persistent +
transients, `ShardingBackend.state_bytes`), the ZeRO paper's formula from docs/REFERENCE.md with this
precision's bytes (fp32: 4 + 4 + 8 per parameter; bf16-mixed: 2 + 2 + 12), and the median step time.
CPU step times compare the modes' overheads on gloo, not GPU speed.

DeepSpeed ZeRO-3 runs twice: with DeepSpeed's defaults (which keep every weight of a model this small
gathered between forward and backward) and with the knobs that shard as the paper draws it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MODEL = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
}
PAPER_KNOBS = {
    "zero_optimization": {
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    }
}
MODES: list[tuple[str, dict[str, Any]]] = [
    ("ddp", {"sharding": "ddp"}),
    ("zero1 (fsdp2: ZeroRedundancyOptimizer)", {"sharding": "zero1"}),
    ("zero2 (fsdp2)", {"sharding": "zero2"}),
    ("zero3 (fsdp2)", {"sharding": "zero3"}),
    ("zero1 (deepspeed)", {"sharding": "zero1", "sharding_backend": "deepspeed"}),
    ("zero2 (deepspeed)", {"sharding": "zero2", "sharding_backend": "deepspeed"}),
    ("zero3 (deepspeed, defaults)", {"sharding": "zero3", "sharding_backend": "deepspeed"}),
    (
        "zero3 (deepspeed, paper knobs)",
        {"sharding": "zero3", "sharding_backend": "deepspeed", "deepspeed_config": "PAPER"},
    ),
]
PRECISIONS = ("fp32", "bf16-mixed")
MEASURED = ("weights", "gradients", "optimizer_states", "buffers", "gathered")


def paper_bytes(mode: str, numel: int, world: int, precision: str) -> int:
    """REFERENCE.md's ZeRO formulas with this precision's bytes per parameter (weights, grads, K)."""
    w, g, k = (2, 2, 12) if precision == "bf16-mixed" else (4, 4, 8)
    if mode.startswith("zero1"):
        return w * numel + g * numel + k * numel // world
    if mode.startswith("zero2"):
        return w * numel + (g + k) * numel // world
    if mode.startswith("zero3"):
        return (w + g + k) * numel // world
    return (w + g + k) * numel


def worker(steps: int, out: Path, scratch: Path) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sharding"))  # the census trainer
    from memtrain.causal_lm.recipe import CausalLMRecipe
    from memtrain.strategies.blocks import model_shape

    from census import CensusTrainer

    paper_json = scratch / "paper.json"
    paper_json.write_text(json.dumps(PAPER_KNOBS))
    rows = []
    for precision in PRECISIONS:
        for label, strategies in MODES:
            strategies = {**strategies, "precision": precision}
            if strategies.get("deepspeed_config") == "PAPER":
                strategies["deepspeed_config"] = str(paper_json)
            run = scratch / f"{len(rows)}"
            recipe = CausalLMRecipe.from_dict(
                {
                    "run": {"name": "bench", "output_dir": str(run), "seed": 0},
                    "model": {"config": MODEL},
                    "data": {"source": "synthetic", "seq_len": 128, "synthetic": {"num_samples": 512}},
                    "batch": {"global_size": 8, "micro_size": 2},
                    "train": {"steps": steps, "lr": 1e-3},
                    "checkpoint": {"at_end": False},
                    "output": {"progress": "off"},
                    "strategies": strategies,
                }
            )
            trainer = CensusTrainer(recipe)
            trainer.fit()
            census: list[Any] = [None] * trainer.env.world_size
            dist.all_gather_object(census, dataclasses.asdict(trainer.census))
            model = trainer.build_model()
            shape = model_shape(model, trainer.blocks(model))
            dim0 = {n: p.shape[0] for n, p in model.named_parameters() if p.dim() > 0}
            estimate = trainer.sharding.state_bytes(shape, trainer.env.world_size, dim0=dim0)
            times = [
                json.loads(line)["step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()
            ]
            rows.append(
                {
                    "mode": label,
                    "precision": precision,
                    "numel": shape.numel,
                    "measured": {k: max(c[k] for c in census) for k in MEASURED},
                    "estimate": dataclasses.asdict(estimate),
                    "estimate_peak": estimate.peak,
                    "paper": paper_bytes(label, shape.numel, trainer.env.world_size, precision),
                    "step_s": statistics.median(times[1:]),
                }
            )
    if dist.get_rank() == 0:
        out.write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| mode | precision | weights | grads | optimizer | DDP buckets | gathered (fwd end) | measured total | "
        "= estimate | estimate (peak) | paper formula | step (s) |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        m = r["measured"]
        exact = "yes" if all(m[k] == r["estimate"][k] for k in MEASURED) else "no"
        lines.append(
            f"| {r['mode']} | {r['precision']} | {mib(m['weights'])} | {mib(m['gradients'])} | "
            f"{mib(m['optimizer_states'])} | {mib(m['buffers'])} | {mib(m['gathered'])} | "
            f"{mib(sum(m.values()))} | {exact} | {mib(r['estimate_peak'])} | {mib(r['paper'])} | "
            f"{r['step_s']:.3f} |"
        )
    numel = rows[0]["numel"]
    return (
        f"Per-rank MiB, max over 2 CPU ranks (gloo), {numel / 1e6:.2f}M parameters. '= estimate': every "
        "measured component equals `state_bytes` to the byte; the estimate's peak adds the modelled transients "
        "(backward prefetch, gradient copies).\n\n" + "\n".join(lines)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.steps, args.worker, args.worker.parent)
        return
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "src"),
            "OMP_NUM_THREADS": "1",
            "TORCH_EXTENSIONS_DIR": str(REPO / ".cache/torch_extensions"),
        }
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                __file__,
                "--steps",
                str(args.steps),
                "--worker",
                str(out),
            ],
            env=env,
            check=True,
            cwd=REPO,
        )
        rows = json.loads(out.read_text())
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
