"""The process group and the few collectives the loop needs.

torchrun (or `accelerate launch`, or the `deepspeed` launcher) sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; memtrain reads nothing else from the environment apart from torchrun's
TORCHELASTIC_* (a rank under a launcher stops when the launcher dies: `launcher_watchdog`). A plain
`python -m memtrain train` is one rank with no process group. Every collective has a timeout so a
dead peer ends the run with an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from memtrain.launcher_watchdog import under_launcher, watch_launcher
from memtrain.mesh import DIMS, MeshShape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

COLLECTIVE_TIMEOUT = timedelta(minutes=float(os.environ.get("MEMTRAIN_COLLECTIVE_TIMEOUT_MIN", "10")))


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group_before: bool = False  # a process group existed before memtrain started (the caller's: kept)
    mesh: MeshShape | None = None  # how the ranks are arranged (None: one data-parallel dimension)
    device_mesh: DeviceMesh | None = dataclasses.field(default=None, compare=False)  # `with_device_mesh`

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def shape(self) -> MeshShape:
        """The arrangement of the ranks (`memtrain.mesh`)."""
        return self.mesh or MeshShape.flat(self.world_size)

    @property
    def dp_rank(self) -> int:
        """The data-parallel rank this process is: which rows of a step's global batch it reads."""
        return self.shape.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.shape.dp_size

    def with_mesh(self, mesh: MeshShape) -> DistEnv:
        return dataclasses.replace(self, mesh=mesh)


def init_distributed() -> DistEnv:
    """Join the process group torchrun describes (nccl on CUDA, gloo on CPU), or run as one rank. Under
    a launcher, the rank also stops when the launcher dies (`launcher_watchdog`)."""
    if under_launcher():
        watch_launcher()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group_before = dist.is_initialized()
    if world_size > 1 and not group_before:
        backend = collective_backend(device)
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend,
            store=_attempt_store(rank, world_size),
            rank=rank,
            world_size=world_size,
            timeout=COLLECTIVE_TIMEOUT,
            **kwargs,
        )
    return DistEnv(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, group_before=group_before
    )


def local_device() -> torch.device:
    """The device this process trains on: the GPU of torchrun's LOCAL_RANK (0 alone), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def collective_backend(device: torch.device) -> str:
    """The process-group backend a run on `device` joins: nccl on CUDA, gloo otherwise (what a rank trace
    models: `memtrain.memory.gloo_buffers`)."""
    return "nccl" if device.type == "cuda" else "gloo"


def _attempt_store(rank: int, world_size: int) -> dist.Store:
    """The rendezvous store of torchrun's environment, keyed by restart.

    torchrun --max-restarts keeps one store for every attempt of the group, and a restarted group would
    read the dead group's addresses from it and fail to connect ("Connection refused"; pytorch#167288).
    A prefix per restart gives each attempt its own keys.
    """
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=COLLECTIVE_TIMEOUT))
    store.set_timeout(COLLECTIVE_TIMEOUT)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"memtrain/attempt_{attempt}", store)


def with_device_mesh(env: DistEnv) -> DistEnv:
    """`env` holding the run's `DeviceMesh` (one named dimension per degree, `memtrain.mesh.DIMS`, size-1
    ones too), built once when a model's strategies are applied and handed to every strategy that needs it
    (`DistEnv.device_mesh`). Needs the process group (or the single rank's own one)."""
    if env.device_mesh is not None:
        return env
    from torch.distributed.device_mesh import init_device_mesh

    built = init_device_mesh(env.device.type, env.shape.degrees, mesh_dim_names=DIMS)
    return dataclasses.replace(env, device_mesh=built)


def data_parallel_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum over the data-parallel ranks of a value every rank holds for its share of the rows (token counts,
    loss sums): the world's sum over the ranks that hold the same rows' values (tensor and pipeline ranks of
    one data-parallel rank), divided by how many hold each."""
    total = all_reduce_sum(value, env)
    copies = env.shape.batch_copies
    if copies == 1:
        return total
    return total // copies if not total.is_floating_point() else total / copies


def all_reduce_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum over ranks (a no-op on one rank). Returns a new tensor; `value` is not modified."""
    out = value.detach().clone()
    if env.distributed:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def any_rank(flag: bool, env: DistEnv) -> bool:
    """Whether `flag` is true on some rank (a collective on several ranks: every rank must call it)."""
    if not env.distributed:
        return flag
    return bool(all_reduce_sum(torch.tensor(int(flag), device=env.device), env) > 0)


def one_process() -> DistEnv:
    """The environment of a process that runs alone (export, a tool reading a run directory)."""
    return DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def broadcast_object(obj: object, env: DistEnv) -> object:
    """Rank 0's value on every rank."""
    if not env.distributed:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(obj: object, env: DistEnv) -> list[object]:
    """Every rank's `obj`, in rank order, on every rank (a collective on several ranks)."""
    if not env.distributed:
        return [obj]
    everyone: list[object] = [None] * env.world_size
    dist.all_gather_object(everyone, obj)
    return everyone


def shutdown(env: DistEnv) -> None:
    """Leave the process group memtrain or a backend it started created (DeepSpeed creates one even for
    a single rank), so a run in a long-lived process (a notebook, a test) leaves none behind; a group
    the caller created before memtrain started is the caller's to end."""
    if dist.is_initialized() and not env.group_before:
        dist.destroy_process_group()
