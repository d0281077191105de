"""The mesh planner against published runs (issue 25; ../shared/REFERENCE.md "Scaling out"), on paper.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_mesh_plan.py [--quick] [--timing-runs 5]

Each case plans a real-scale recipe for the cluster torchtitan published (H100 96 GB, 8 per node, 400 Gb/s per
GPU between nodes: configs/h100-96gb.yaml) or the issue names (h100-80gb), through the same `plan_meshes`
`memtrain plan` runs, and prints the busiest rank's predicted peak next to the published figure. The
published memory is *reserved* GiB; the prediction here is allocated bytes (what the tracker counts), so a
gap is expected there (allocator slack) and in what torchtitan runs and memtrain does not model
(torch.compile, float8 linears, async TP). `--quick` skips the context-parallel sweep and the 1,024-GPU
timing (the two slowest); `--only TEXT` plans only the cases whose name contains TEXT (e.g. `--quick --only
selective-op`). Prints a markdown table for docs/BENCHMARKS.md and, last, the planning time of the 1,024-GPU
what-if (median of `--timing-runs`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memtrain.commands.plan import _at_sequence, _spec
from memtrain.commands.trainers import load_checked_recipe, trainer_class
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.planner import plan_meshes
from memtrain.planner.mesh_search import MeshResult, MeshScored

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
FULL = ["strategies.checkpointing=full", "strategies.sharding=zero3", "strategies.loss=standard"]


@dataclass(frozen=True)
class Case:
    name: str
    recipe: str
    world: int
    overrides: tuple[str, ...]
    published: str
    gpu: str = "h100-96gb"


def _mesh(**degrees: object) -> tuple[str, ...]:
    return tuple(f"strategies.mesh.{k}={v}" for k, v in degrees.items())


LLAMA8B, LLAMA70B, LLAMA405B = (
    "recipes/llama3-8b-8xh100.yaml",
    "recipes/llama-70b-64gpu.yaml",
    "recipes/llama-405b.yaml",
)


def _fsdp_8b(mode: str, ranks: int, published: str) -> Case:
    """Llama 3.1 8B, FSDP over `ranks`, 2 rows of 8,192 per rank, `mode` checkpointing."""
    return Case(
        f"8B FSDP {ranks}, batch 2, {mode}",
        LLAMA8B,
        ranks,
        (
            f"strategies.checkpointing={mode}",
            "strategies.sharding=zero3",
            "strategies.loss=standard",
            "batch.micro_size=2",
            f"batch.global_size={2 * ranks}",
            *_mesh(dp_shard=ranks),
        ),
        published,
    )


# torchtitan's selective AC of the published table is its op mode: memtrain's `selective-op` (issue 39);
# `selective` (every matmul output kept) is the row it was first compared with.
CASES = [
    _fsdp_8b("selective", 8, "82.4"),
    _fsdp_8b("selective", 128, "67.0"),
    _fsdp_8b("selective-op", 8, "82.4"),
    _fsdp_8b("selective-op", 128, "67.0"),
    Case(
        "405B FSDP 128 (1-D), batch 1, full",
        LLAMA405B,
        128,
        (*FULL, "batch.global_size=128", *_mesh(dp_shard=128, tp=1, pp=1)),
        "OOM",
    ),
    Case(
        "405B FSDP 16 x TP 8, batch 2, full",
        LLAMA405B,
        128,
        (*FULL, "batch.micro_size=2", "batch.global_size=32", *_mesh(dp_shard=16, tp=8, pp=1)),
        "trains",
    ),
    Case(
        "70B FSDP 32 x TP 8, batch 16, full",
        LLAMA70B,
        256,
        (
            *FULL,
            "data.seq_len=8192",
            "batch.micro_size=16",
            "batch.global_size=512",
            *_mesh(dp_shard=32, tp=8),
        ),
        "71.9",
    ),
    Case(
        "405B FSDP 8 x TP 8 x PP 8, 1F1B (8 x 4 rows)",
        LLAMA405B,
        512,
        (
            *FULL,
            "batch.micro_size=4",
            "batch.global_size=256",
            *_mesh(dp_shard=8, tp=8, pp=8, pp_schedule="1f1b"),
        ),
        "82.5",
    ),
    Case(
        "405B FSDP 8 x TP 8 x PP 8, interleaved 1F1B (16 x 2 rows)",
        LLAMA405B,
        512,
        (
            *FULL,
            "batch.micro_size=2",
            "batch.global_size=256",
            *_mesh(dp_shard=8, tp=8, pp=8, pp_schedule="interleaved_1f1b"),
        ),
        "72.7",
    ),
    Case(
        "70B on 64 H100 80GB, mesh open",
        LLAMA70B,
        64,
        (*FULL, *_mesh(tp="auto", pp="auto")),
        "-",
        "h100-80gb",
    ),
    Case("405B on 1,024 H100 80GB, mesh open", LLAMA405B, 1024, tuple(FULL), "-", "h100-80gb"),
]
CONTEXT = [
    Case(
        f"8B FSDP {8 // c} x CP {c}, seq {32768 * c}, batch 1, full",
        LLAMA8B,
        8,
        (
            *FULL,
            f"data.seq_len={32768 * c}",
            "model.config.max_position_embeddings=262144",
            "batch.micro_size=1",
            "batch.global_size=" + str(8 // c),
            *_mesh(dp_shard=8 // c, cp=c),
        ),
        published,
    )
    for c, published in ((1, "83.9"), (2, "84.2"), (4, "84.0"), (8, "84.5"))
]


def plan(case: Case) -> MeshResult:
    trainer = trainer_class(None)
    path = str(REPO / case.recipe)
    recipe = load_checked_recipe(path, list(case.overrides), trainer)
    gpu = load_gpu(case.gpu)
    target = what_if_target(case.world, gpu, None, recipe.planner.safety_fraction)
    return plan_meshes(
        recipe,
        _spec(trainer, recipe),
        target,
        gpu.cluster,
        spec_at=lambda seq: _spec(trainer, _at_sequence(path, list(case.overrides), trainer, seq)),
        progress=lambda _line: None,
    )


def row(case: Case, result: MeshResult) -> str:
    best: MeshScored | None = result.chosen or result.best_misfit
    assert best is not None
    fits = (
        "fits"
        if result.chosen is not None
        else f"does not fit ({(best.required - result.target.budget.usable) / GiB:.1f} GiB short)"
    )
    crossing = ",".join(best.mesh.crossing(result.cluster.gpus_per_node)) or "none"
    reserved = f"{best.reserved / GiB:.1f}" if best.reserved is not None else "-"
    return (
        f"| {case.name} | {case.world} x {case.gpu} | {best.mesh.describe()} | {best.peak / GiB:.1f} | {reserved} | {fits} | "
        f"{case.published} | {best.tokens_per_second:,.0f} | {crossing} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timing-runs", type=int, default=5)
    parser.add_argument("--only", default="", help="plan only the cases whose name contains this (no timing)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| case | GPUs | mesh (busiest rank) | predicted allocated GiB | predicted reserved GiB | | published GiB (reserved) | tokens/s/GPU | crosses nodes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in CASES[:-1] + ([] if args.quick else CONTEXT):
        if args.only in case.name:
            print(row(case, plan(case)), flush=True)
    if args.quick or args.only:
        return
    seconds = []
    for _ in range(args.timing_runs):
        started = time.perf_counter()
        result = plan(CASES[-1])
        seconds.append(time.perf_counter() - started)
    print(row(CASES[-1], result))
    print(
        f"\n405B on 1,024 GPUs, whole what-if (probe, traces, search): median {statistics.median(seconds):.1f} s "
        f"of {len(seconds)} ({', '.join(f'{s:.1f}' for s in seconds)}); the search alone {result.seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
