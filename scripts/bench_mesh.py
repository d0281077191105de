"""Step time of each mesh on 4 CPU ranks, as ratios to 1-D FSDP of the same model, as a markdown table.

    OMP_NUM_THREADS=1 python scripts/bench_mesh.py [--steps 8] [--json out.json]

It trains a small llama (4 layers, hidden 128, 8 heads, 4 KV heads, vocabulary 1024; 1.1M parameters) with
`memtrain train` under torchrun (4 gloo ranks, one launch per mesh) and reads each run's metrics: the median
step time of the steps after the first two, and the final loss (the meshes train the same job, so the
losses agree to fp32 rounding). CPU gloo times compare the meshes' overheads (more, smaller collectives for
tensor parallelism; a second reduction dimension for HSDP), not GPU speed: on a GPU tensor parallelism
trades those collectives for smaller matmuls and activations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MESHES = {  # name -> strategies overrides (every one zero3 on FSDP2 but the pure tensor-parallel one)
    "FSDP 4 (1-D)": [],
    "HSDP 2 x 2": ["strategies.mesh.dp_replicate=2", "strategies.mesh.dp_shard=2"],
    "FSDP 2 x TP 2 (sequence parallel)": ["strategies.mesh.dp_shard=2", "strategies.mesh.tp=2"],
    "FSDP 2 x TP 2 (no sequence parallel)": [
        "strategies.mesh.dp_shard=2",
        "strategies.mesh.tp=2",
        "strategies.mesh.sequence_parallel=false",
    ],
    "TP 4": ["strategies.mesh.dp_shard=1", "strategies.mesh.tp=4", "strategies.sharding=none"],
}
MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 128,
}


def recipe(run_dir: Path, steps: int) -> dict[str, Any]:
    return {
        "run": {"name": "bench-mesh", "output_dir": str(run_dir), "seed": 1},
        "model": {"config": MODEL},
        "data": {"source": "synthetic", "seq_len": 64, "synthetic": {"num_samples": 512, "min_len": 64}},
        "batch": {"global_size": 16, "micro_size": 2},
        "train": {"steps": steps, "lr": 1e-3, "warmup_steps": 0},
        "checkpoint": {"every": 0, "at_end": False},
        "output": {"progress": "off"},
        "strategies": {"precision": "fp32", "sharding": "zero3", "checkpointing": "none"},
    }


def run_mesh(name: str, overrides: list[str], steps: int, work: Path) -> dict[str, Any]:
    run_dir = work / name.replace(" ", "_").replace("(", "").replace(")", "")
    path = run_dir.with_suffix(".json")
    path.write_text(json.dumps(recipe(run_dir, steps)))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "-m", "memtrain", "train", str(path), *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        return {"mesh": name, "error": done.stderr.strip().splitlines()[-1][:200]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [row["step_time_s"] for row in rows[2:]] or [row["step_time_s"] for row in rows]
    return {"mesh": name, "step_s": statistics.median(times), "final_loss": rows[-1]["loss"]}


def table(results: list[dict[str, Any]]) -> str:
    base = next(r["step_s"] for r in results if "step_s" in r)
    lines = ["| mesh (4 CPU ranks) | median step (s) | vs FSDP 4 | final loss |", "|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['mesh']} | failed: {r['error']} | | |")
            continue
        lines.append(
            f"| {r['mesh']} | {r['step_s']:.3f} | {r['step_s'] / base:.2f}x | {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        results = [run_mesh(name, overrides, args.steps, Path(work)) for name, overrides in MESHES.items()]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
