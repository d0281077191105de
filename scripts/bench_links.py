"""The links a run's start measures on each mesh dimension (training/link_timing.py), repeated, as a table.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 scripts/bench_links.py [--dp-shard 2 --tp 2]
        [--repeats 5]

Each repeat times the run's collectives as a run's start does and fits each dimension's link; rank 0 prints
the median and the range over the repeats of each dimension's bandwidth and latency, and of the seconds
the measurement took. The cache goes to a temporary directory, so this machine's own cache is left alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from memtrain.distributed import init_distributed, shutdown
from memtrain.mesh import MeshShape
from memtrain.training.link_timing import measure_links


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dp-shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["MEMTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="memtrain-links-")
    env = init_distributed()
    env = env.with_mesh(MeshShape(dp_shard=args.dp_shard, tp=args.tp))
    records = []
    for _ in range(args.repeats):
        env, record = measure_links(env, enabled=True)
        records.append(record)
    if env.is_main:
        print(table([r for r in records if r is not None]))
    shutdown(env)


def table(records: list[dict[str, Any]]) -> str:
    """Median (min-max) per dimension over the repeats."""

    def spread(values: list[float], scale: float, unit: str) -> str:
        v = [x * scale for x in values]
        return f"{statistics.median(v):.3g} {unit} ({min(v):.3g}-{max(v):.3g})"

    lines = ["| dimension | ranks | bandwidth | latency |", "|---|---|---|---|"]
    for i, first in enumerate(records[0]["links"]):
        found = [r["links"][i] for r in records]
        lines.append(
            f"| {first['dim']} | {first['ranks']} | {spread([f['bandwidth'] for f in found], 1e-9, 'GB/s')} | "
            f"{spread([f['latency'] for f in found], 1e6, 'us')} |"
        )
    seconds = spread([r["seconds"] for r in records], 1.0, "s")
    return "\n".join([*lines, "", f"measured in {seconds} per run start, {len(records)} repeats"])


if __name__ == "__main__":
    main()
