"""Each mesh dimension's link timed at the start of a run on several ranks (planner/link_calibration.py).

Why at the start, with the run's own groups: the links a mesh plan assumes (memtrain.cluster) are a usual
node's; the groups this run's collectives use are here, so a few all-gathers and all-reduces of a small and
a larger tensor over each dimension's group (a warm-up, then the fastest of `REPEATS`: scheduling and other
jobs only ever add time) fit what that dimension really crosses, in a fraction of a second. The
`DeviceMesh` is built here, once, and handed back: the strategies applied after it (FSDP2, tensor
parallelism) reuse it (`with_device_mesh`)."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from memtrain.distributed import DistEnv, with_device_mesh
from memtrain.mesh import DIMS
from memtrain.planner import link_calibration as links
from memtrain.planner.link_calibration import MeasuredLink, Timing

SIZES = (256, 4 * 2**20)  # bytes of the whole tensor: latency dominates the first, bandwidth the second
REPEATS = 3  # timed calls of each collective and size, after one warm-up call


def measure_links(env: DistEnv, enabled: bool) -> tuple[DistEnv, dict[str, Any] | None]:
    """Time each mesh dimension's group (a collective on every rank) and fit its link; rank 0 caches the
    links, prints one line (measured against assumed) and gets the record for plan.json. Nothing is timed on
    one rank, with `planner.measure_links: false` or with `MEMTRAIN_CACHE_DIR=off`. Returns `env` with the
    run's `DeviceMesh` on a mesh, and the record (None on other ranks and when nothing was timed)."""
    if not env.distributed or not enabled or links.links_path() is None:
        return env, None
    started = time.perf_counter()
    if env.shape.is_flat:
        groups: dict[str, Any] = {"dp_shard": dist.group.WORLD}
    else:
        env = with_device_mesh(env)
        assert env.device_mesh is not None
        groups = {dim: env.device_mesh.get_group(dim) for dim in DIMS if getattr(env.shape, dim) > 1}
    cluster = links.launch_cluster(env.world_size)
    crossing = env.shape.crossing(cluster.gpus_per_node)
    measured = []
    for dim, group in groups.items():
        ranks = dist.get_world_size(group)
        timings = [_time(kind, size, group, ranks, env.device) for kind in links.RING_STEPS for size in SIZES]
        measured.append(MeasuredLink(dim, ranks, dim in crossing, links.fit_link(timings)))
    if not env.is_main:
        return env, None
    key = links.layout_key(env.device, cluster, env.world_size)
    path = links.store(key, measured)
    seconds = time.perf_counter() - started
    print(
        f"[memtrain] links measured in {seconds:.2f} s: {links.describe(measured, cluster)}",
        file=sys.stderr,
        flush=True,
    )
    return env, {
        "key": key,
        "seconds": seconds,
        "links": [m.to_dict() for m in measured],
        "cache": str(path) if path is not None else None,
    }


def _time(kind: str, nbytes: int, group: Any, ranks: int, device: torch.device) -> Timing:
    """The fastest seconds of `kind` over `group` on a float32 tensor of about `nbytes` in all."""
    elements = max(nbytes // 4 // ranks, 1) * ranks
    whole = torch.zeros(elements, device=device)
    piece = torch.zeros(elements // ranks, device=device)
    seconds = []
    for _ in range(1 + REPEATS):
        dist.barrier(group=group)
        start = time.perf_counter()
        if kind == "all_gather":
            dist.all_gather_single(whole, piece, group=group)
        else:
            dist.all_reduce(whole, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return Timing(kind, ranks, elements * 4, min(seconds[1:]))
