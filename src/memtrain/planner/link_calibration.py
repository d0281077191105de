"""The links of the cluster that is here, fitted to collectives timed at the start of a run on several ranks.

Why: the mesh search ranks meshes by the seconds each dimension's collectives take over the link its group
crosses (mesh_cost.py), and a GPU profile's links (configs/NAME.yaml, memtrain.cluster) describe a usual
node, not this one: another NIC, a PCIe-only box, or gloo on CPUs (about a GB/s, not NVLink's 360). So a run
on several ranks times a few all-gathers and all-reduces over each mesh dimension's group
(training/link_timing.py), fits the dimension's `Link` here (`fit_link`: latency from the small size,
bandwidth from the large one, in `Link`'s units: bus bandwidth per GPU in one direction, (n-1)/n of the
whole per ring collective), and keeps them in a small JSON cache beside the step-time one. A later plan
for this machine (`plan_meshes` for a target that is here: `memtrain plan` without --gpu, and a run's
`choose_mesh`) ranks with the measured links (`here_cluster`): a dimension whose group crossed nodes
measured the `between` link, one within a node the `within` link.

The cache is `$MEMTRAIN_CACHE_DIR/links.json` (`MEMTRAIN_CACHE_DIR=off`, or `planner.measure_links:
false`, measures nothing). One entry per device and world layout (`layout_key`: the GPU's name or the
CPU's model, GPUs per node, nodes, the torch version), written atomically; an entry that cannot be read, or
a link that is not two positive numbers, is ignored with a warning, as the step-time cache is
(step_time_calibration.py).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from memtrain.cluster import DEFAULT_CLUSTER, Cluster, Link
from memtrain.errors import MemtrainError
from memtrain.json_out import write_atomic
from memtrain.planner.step_time_calibration import CACHE_ENV, cache_path, cpu_model, read_cache

CACHE_FILE = "links.json"
VERSION = 1  # of the cache's layout: an entry of another version is ignored
RING_STEPS = {"all_gather": 1, "all_reduce": 2}
"""Ring passes per collective: an all-reduce is a reduce-scatter then an all-gather (REFERENCE.md)."""


@dataclass(frozen=True)
class Timing:
    """One timed collective: its kind (a key of `RING_STEPS`), the ranks of its group, the bytes of the whole
    (gathered or reduced) tensor and the seconds it took."""

    collective: str
    ranks: int
    nbytes: int
    seconds: float

    @property
    def moved(self) -> float:
        """Bytes each rank sends: (n-1)/n of the whole per ring pass."""
        return RING_STEPS[self.collective] * self.nbytes * (self.ranks - 1) / self.ranks

    @property
    def steps(self) -> int:
        """Ring steps, each paying the link's latency once."""
        return RING_STEPS[self.collective] * (self.ranks - 1)


@dataclass(frozen=True)
class MeasuredLink:
    """One mesh dimension's fitted link: its group's ranks and whether the group spans several nodes."""

    dim: str
    ranks: int
    crosses_nodes: bool
    link: Link

    def to_dict(self) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "ranks": self.ranks,
            "crosses_nodes": self.crosses_nodes,
            "bandwidth": self.link.bandwidth,
            "latency": self.link.latency,
        }


def fit_link(timings: Sequence[Timing]) -> Link:
    """The `Link` whose `ring_seconds` best match `timings` (least squares of seconds = moved / bandwidth +
    steps x latency); `ValueError` unless two sizes pin both. When noise leaves a term not positive, the
    bound each size gives alone stands in: latency from the smallest size's seconds per step, bandwidth
    from the largest size's bytes per second."""
    if len({t.moved / t.steps for t in timings if t.steps}) < 2:
        raise ValueError("fitting a link needs collectives of two sizes")
    xx = sum(t.moved**2 for t in timings)
    xy = sum(t.moved * t.steps for t in timings)
    yy = sum(t.steps**2 for t in timings)
    xs = sum(t.moved * t.seconds for t in timings)
    ys = sum(t.steps * t.seconds for t in timings)
    det = xx * yy - xy * xy
    per_byte, latency = (xs * yy - ys * xy) / det, (xx * ys - xy * xs) / det
    if per_byte <= 0:
        largest = max(timings, key=lambda t: t.moved)
        per_byte = largest.seconds / largest.moved
    if latency <= 0:
        smallest = min(timings, key=lambda t: t.moved)
        latency = smallest.seconds / smallest.steps
    return Link(bandwidth=1 / per_byte, latency=latency)


def launch_cluster(world_size: int) -> Cluster:
    """The cluster this launch runs on as a plan assumes it before any measurement: torchrun's
    LOCAL_WORLD_SIZE ranks per node (all of them on one node without it), the default links."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return replace(DEFAULT_CLUSTER, gpus_per_node=per_node)


def layout_key(device: torch.device, cluster: Cluster, world_size: int) -> str:
    """What the cache is keyed by: the device's name (the GPU's, or the CPU's model), the layout of
    `world_size` ranks on `cluster` (nodes x the ranks a node holds: 4 ranks on a node of 8 are the 4 that
    a launch of 4 per node measured) and the torch version (a new torch can change every collective's
    speed)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    per_node = min(cluster.gpus_per_node, world_size)
    layout = f"{cluster.nodes(world_size)} node(s) x {per_node}"
    return f"{device.type}: {name}; {layout}; torch {torch.__version__}"


def links_path() -> Path | None:
    """Where the cache lives (beside step_time.json); None when `MEMTRAIN_CACHE_DIR=off`."""
    steps = cache_path()
    return steps.with_name(CACHE_FILE) if steps is not None else None


def load(key: str) -> list[MeasuredLink] | None:
    """The links cached for `key`, or None (no cache, no entry, or one that cannot be read: a warning)."""
    entry = _read_all().get(key)
    if entry is None:
        return None
    try:
        if entry["version"] != VERSION:
            return None
        found = [
            MeasuredLink(
                str(raw["dim"]),
                int(raw["ranks"]),
                bool(raw["crosses_nodes"]),
                Link(float(raw["bandwidth"]), float(raw["latency"])),
            )
            for raw in entry["links"]
        ]
    except (KeyError, TypeError, ValueError):
        _warn(f"ignoring the unreadable entry for {key!r}")
        return None
    if not all(_positive(m.link.bandwidth) and _positive(m.link.latency) for m in found):
        _warn(f"ignoring the damaged entry for {key!r}: a bandwidth or latency is not a positive number")
        return None
    return found


def store(key: str, measured: Sequence[MeasuredLink]) -> Path | None:
    """Write `measured` as `key`'s entry (other entries kept); the path, or None when the cache is off or
    cannot be written (a warning says why)."""
    path = links_path()
    if path is None:
        return None
    entries = _read_all()
    entries[key] = {"version": VERSION, "links": [m.to_dict() for m in measured]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, entries)
    except (OSError, MemtrainError) as exc:
        _warn(f"cannot write {path} ({exc}); set {CACHE_ENV} to a writable directory or off")
        return None
    return path


def with_links(cluster: Cluster, measured: Sequence[MeasuredLink]) -> Cluster:
    """`cluster` with its within- and between-node links replaced by the measured ones (each from the
    dimension of the most ranks that measured it; an unmeasured kind keeps the assumed link)."""

    def widest(crossing: bool) -> Link | None:
        kind = [m for m in measured if m.crosses_nodes == crossing]
        return max(kind, key=lambda m: m.ranks).link if kind else None

    return replace(
        cluster,
        within=widest(False) or cluster.within,
        between=widest(True) or cluster.between,
    )


def here_cluster(cluster: Cluster, world_size: int, device: torch.device) -> tuple[Cluster, str | None]:
    """`cluster` as this machine measured it for `world_size` ranks (`with_links`), and a line saying
    measured against assumed; `cluster` itself and None without a cached measurement."""
    if links_path() is None:
        return cluster, None
    measured = load(layout_key(device, cluster, world_size))
    if not measured:
        return cluster, None
    here = with_links(cluster, measured)
    return here, f"links measured here: {describe(measured, cluster)}"


def describe(measured: Sequence[MeasuredLink], assumed: Cluster) -> str:
    """Each dimension's measured link against the one the profile assumed, e.g. `tp (within a node)
    1.2 GB/s, 150 us (assumed 360 GB/s, 5 us)`."""
    parts = []
    for m in measured:
        before = assumed.between if m.crosses_nodes else assumed.within
        where = "between nodes" if m.crosses_nodes else "within a node"
        parts.append(f"{m.dim} ({where}) {_link(m.link)} (assumed {_link(before)})")
    return "; ".join(parts)


def _link(link: Link) -> str:
    return f"{link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} us"


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _read_all() -> dict[str, Any]:
    return read_cache(links_path(), _warn, "the link cache")


def _warn(message: str) -> None:
    print(f"[memtrain] link calibration: {message}", file=sys.stderr, flush=True)
