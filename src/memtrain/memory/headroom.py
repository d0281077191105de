"""How many bytes a plan may use: measured headroom, the simulated budget, or a what-if GPU.

Why measured and not the spec sheet: the CUDA context, other processes and the driver take their share
before training starts, and ranks of one job can see different free memory. On CUDA the planner reads
`torch.cuda.mem_get_info` after the process group exists (NCCL's context is then there too), takes the
minimum over ranks (the plan must fit on the fullest GPU), keeps a reserve for NCCL's buffers, which
appear at the first collective, and then a small safety fraction for what no prediction sees.
On CPU the budget is the simulated device budget (`memory.budget`: the tracker raises a real
`torch.OutOfMemoryError` past it), else the host's available memory. Without the hardware, a GPU profile
from configs/ (`--gpu h100-80gb`) or a size (`--gpu-memory 24GiB`) stands in: total as torch reports
it, less the CUDA context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memtrain.cluster import DEFAULT_CLUSTER, Cluster, Link
from memtrain.distributed import DistEnv
from memtrain.errors import PlanError, RecipeError, did_you_mean
from memtrain.mesh import MeshShape
from memtrain.yamlfile import read_yaml

CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parents[3] / "configs")
NCCL_RESERVE_BYTES = 512 * 2**20  # NCCL's communicator buffers, allocated at the first collective
# what no prediction sees (other processes, the driver's growth during a run). On CUDA the allocator's slack
# is replayed (planner/reserved.py) and the prediction error is planner.reserved_margin's, measured against
# published runs (planner/prediction_error.py): this share was 0.10 when it stood for both, and refused
# runs that trained at 88% of the card and were predicted within 2%.
SAFETY_FRACTION = {"cuda": 0.02, "cpu": 0.02}
DEFAULT_CUDA_CONTEXT_BYTES = 2**30  # --gpu-memory without a profile
DEFAULT_HOST_MEMORY_BYTES = 64 * 2**30  # host memory per GPU of a profile without host_memory_bytes, or
# of --gpu-memory: a cautious share of a GPU server's memory (a DGX H100's 2 TB is 256 GB per GPU)
DEFAULT_COMPUTE_CAPABILITY = (8, 0)  # --gpu-memory without a profile: an sm80 GPU, as bf16 is assumed


@dataclass(frozen=True)
class GpuProfile:
    """Facts of one GPU model from configs/NAME.yaml."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    bf16: bool
    fp8: bool
    cuda_context_bytes: int
    host_memory_bytes: int = DEFAULT_HOST_MEMORY_BYTES  # host memory per GPU (what offload may fill)
    cluster: Cluster = DEFAULT_CLUSTER  # the node it sits in and the links between GPUs (memtrain.cluster)


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes per rank: the device's total, what is free, what is held back, what a plan may use."""

    total: int
    free: int
    reserve: int
    usable: int
    source: str

    def to_dict(self) -> dict[str, int]:
        return {"total": self.total, "free": self.free, "reserve": self.reserve, "usable": self.usable}


@dataclass(frozen=True)
class Target:
    """Where the plan runs: device kind, ranks, budget and what the device can compute in."""

    device_type: str
    world_size: int
    budget: MemoryBudget
    bf16: bool
    fp8: bool
    what_if: bool = False  # described by a GPU profile or a size, not present in this process
    host_bytes: int | None = None  # host memory per rank that offloaded states may use (None: not checked)
    compute_capability: tuple[int, int] | None = None  # a CUDA GPU's (which attention kernels it runs)
    mesh: MeshShape | None = None  # how the ranks are arranged (None: one data-parallel dimension)

    @property
    def shape(self) -> MeshShape:
        return self.mesh or MeshShape.flat(self.world_size)


def load_gpu(name: str) -> GpuProfile:
    """A GPU profile by name (configs/NAME.yaml) or by path to such a file."""
    path = Path(name)
    if not path.is_file():
        found = [d / f"{name}.yaml" for d in CONFIG_DIRS if (d / f"{name}.yaml").is_file()]
        if not found:
            known = sorted({p.stem for d in CONFIG_DIRS if d.is_dir() for p in d.glob("*.yaml")})
            raise PlanError(
                f"--gpu: no GPU profile {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}"
            )
        path = found[0]
    return _read_profile(path)


def _read_profile(path: Path) -> GpuProfile:
    """The profile in `path`, read as a recipe is (bounded YAML, UTF-8); `PlanError` naming --gpu and
    the file when it cannot be read or lacks a field."""
    try:
        raw = read_yaml(path)
        major, _, minor = str(raw["compute_capability"]).partition(".")
        return GpuProfile(
            name=str(raw["name"]),
            memory_bytes=int(raw["memory_bytes"]),
            compute_capability=(int(major), int(minor or 0)),
            bf16=bool(raw["bf16"]),
            fp8=bool(raw["fp8"]),
            cuda_context_bytes=int(raw["cuda_context_bytes"]),
            host_memory_bytes=int(raw.get("host_memory_bytes", DEFAULT_HOST_MEMORY_BYTES)),
            cluster=_cluster(raw),
        )
    except RecipeError as exc:
        raise PlanError(f"--gpu: {path}: {'; '.join(exc.problems)}") from None
    except KeyError as exc:
        raise PlanError(f"--gpu: {path} is not a GPU profile: it has no {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise PlanError(f"--gpu: {path} is not a GPU profile ({exc})") from None


def _cluster(raw: dict[str, Any]) -> Cluster:
    """The node a profile describes; `DEFAULT_CLUSTER`'s figures for the keys it leaves out."""
    d = DEFAULT_CLUSTER
    gpus = int(raw.get("gpus_per_node", d.gpus_per_node))
    if gpus < 1:
        raise ValueError(f"gpus_per_node must be at least 1 (it was {gpus})")
    return Cluster(
        gpus_per_node=gpus,
        within=Link(
            float(raw.get("intra_node_bandwidth", d.within.bandwidth)),
            float(raw.get("intra_node_latency", d.within.latency)),
        ),
        between=Link(
            float(raw.get("inter_node_bandwidth", d.between.bandwidth)),
            float(raw.get("inter_node_latency", d.between.latency)),
        ),
    )


def budget_from(total: int, free: int, reserve: int, safety: float, source: str) -> MemoryBudget:
    usable = int(max(0, free - reserve) * (1.0 - safety))
    return MemoryBudget(total=total, free=free, reserve=reserve, usable=usable, source=source)


def safety_for(device_type: str, configured: float | None) -> float:
    return SAFETY_FRACTION.get(device_type, SAFETY_FRACTION["cuda"]) if configured is None else configured


def what_if_target(
    world_size: int,
    gpu: GpuProfile | None,
    memory_bytes: int | None,
    safety: float | None,
    host_memory_bytes: int | None = None,
) -> Target:
    """A CUDA target described by a profile and/or a memory size, without the hardware. Offloaded states
    may use `host_memory_bytes` (else the profile's host memory per GPU, else
    `DEFAULT_HOST_MEMORY_BYTES`) less the safety fraction."""
    total = memory_bytes if memory_bytes is not None else gpu.memory_bytes if gpu is not None else None
    if total is None:
        raise PlanError("what-if planning needs --gpu NAME or --gpu-memory SIZE")
    context = gpu.cuda_context_bytes if gpu is not None else DEFAULT_CUDA_CONTEXT_BYTES
    reserve = NCCL_RESERVE_BYTES if world_size > 1 else 0
    label = gpu.name if gpu is not None else "GPU"
    budget = budget_from(
        total,
        total - context,
        reserve,
        safety_for("cuda", safety),
        f"what-if: {world_size} x {label}, {total / 2**30:.2f} GiB each, less the CUDA context",
    )
    return Target(
        "cuda",
        world_size,
        budget,
        bf16=gpu.bf16 if gpu is not None else True,
        fp8=gpu.fp8 if gpu is not None else False,
        what_if=True,
        host_bytes=int(
            (
                host_memory_bytes
                if host_memory_bytes is not None
                else gpu.host_memory_bytes
                if gpu is not None
                else DEFAULT_HOST_MEMORY_BYTES
            )
            * (1.0 - safety_for("cuda", safety))
        ),
        compute_capability=gpu.compute_capability if gpu is not None else DEFAULT_COMPUTE_CAPABILITY,
    )


def measured_target(
    env: DistEnv, simulated_budget: int | None, safety: float | None, free_override: int | None = None
) -> Target:
    """The target this process runs on; on several ranks the budget is the minimum over ranks.
    `free_override` replaces this rank's measured free bytes (tests inject uneven headroom with it)."""
    device = env.device.type
    capability: tuple[int, int] | None = None
    host: int | None = None  # on CPU the host is the device: offload has nowhere to go
    if device == "cuda":
        host = int(_host_memory()[1] / _ranks_per_host() * (1.0 - safety_for("cuda", safety)))
        free, total = torch.cuda.mem_get_info(env.device)
        bf16 = torch.cuda.is_bf16_supported()
        capability = torch.cuda.get_device_capability(env.device)
        fp8 = capability >= (8, 9)
        reserve = NCCL_RESERVE_BYTES if env.distributed else 0
        source = "measured (torch.cuda.mem_get_info)"
    elif simulated_budget is not None:
        free = total = simulated_budget
        bf16, fp8, reserve, source = True, False, 0, "simulated (memory.budget)"
    else:
        total, free = _host_memory()
        bf16, fp8, reserve, source = True, False, 0, "host memory (no memory.budget set)"
    if free_override is not None:
        free = free_override
    if env.distributed:
        free, total = _min_over_ranks(free, env), _min_over_ranks(total, env)
        source += f", minimum over {env.world_size} ranks"
    budget = budget_from(total, free, reserve, safety_for(device, safety), source)
    if host is not None and env.distributed:
        host = _min_over_ranks(host, env)
    return Target(
        device,
        env.world_size,
        budget,
        bf16=bf16,
        fp8=fp8,
        host_bytes=host,
        compute_capability=capability,
        mesh=env.mesh,
    )


def _ranks_per_host() -> int:
    """Ranks sharing this host's memory: torchrun's LOCAL_WORLD_SIZE, else one per visible GPU."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) > 0 else max(torch.cuda.device_count(), 1)


def _host_memory() -> tuple[int, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


def _min_over_ranks(value: int, env: DistEnv) -> int:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
