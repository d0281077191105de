"""`Cluster`: the nodes a job runs on and the links between its GPUs, what a mesh plan's communication costs.

Why its own object: the mesh search (planner/mesh_search.py) ranks arrangements of N GPUs by predicted
tokens/s, and a collective's time depends on the link its group crosses: NVLink within a node is about ten
times faster per GPU than the network between nodes. A GPU profile (configs/NAME.yaml) describes the node
its GPU usually sits in (`gpus_per_node`, the bandwidth and latency of each link); `memtrain plan --nodes
--gpus-per-node` override it. Which mesh dimensions cross nodes is `MeshShape.crossing` (torchrun puts
consecutive ranks on one node).

Bandwidths are per GPU in one direction, as much as a ring collective moves (NCCL's "bus bandwidth"), not
the link's marketing figure; latencies are per ring step.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtrain.mesh import MeshShape


@dataclass(frozen=True)
class Link:
    """One kind of link: bytes/s per GPU in one direction, seconds per ring step."""

    bandwidth: float
    latency: float

    def ring_seconds(self, nbytes: float, ranks: int, collectives: int = 1) -> float:
        """Seconds `collectives` ring all-gathers or reduce-scatters of `nbytes` (the whole, unsharded
        size) take over `ranks` ranks: each rank sends (ranks - 1) / ranks of it, in ranks - 1 steps."""
        if ranks <= 1:
            return 0.0
        steps = ranks - 1
        return nbytes * steps / ranks / self.bandwidth + collectives * steps * self.latency


@dataclass(frozen=True)
class Cluster:
    """GPUs per node and the link within and between nodes."""

    gpus_per_node: int
    within: Link
    between: Link

    def link(self, mesh: MeshShape, dims: tuple[str, ...]) -> Link:
        """The link a group spanning mesh dimensions `dims` crosses: between nodes when any of them does."""
        crossing = set(mesh.crossing(self.gpus_per_node))
        return self.between if crossing & set(dims) else self.within

    def nodes(self, world_size: int) -> int:
        return -(-world_size // self.gpus_per_node)


DEFAULT_CLUSTER = Cluster(
    gpus_per_node=8,
    # NVLink 4 (H100 SXM): 450 GB/s per direction, ~80% of it as ring bus bandwidth
    within=Link(bandwidth=360e9, latency=5e-6),
    # 400 Gb/s InfiniBand / RoCE per GPU (50 GB/s), ~80% of it
    between=Link(bandwidth=40e9, latency=15e-6),
)
