"""DDP construction with an optional gradient-communication hook (`strategies.comm_hook`).

Why hooks: on a slow interconnect the gradient all-reduce dominates a DDP step. `bf16` sends the
buckets in bf16 (half the bytes; each rank's contribution is rounded to 8 significant bits before the
sum, and the averaged result is written back in fp32), `powersgd` sends a rank-1 low-rank
approximation with error feedback (torch's PowerSGD, its defaults: plain all-reduce for the first
1000 steps while the model warms up, then compression). Both average over ranks, like plain DDP, so
`grad_sync_scale` stays the world size.

PowerSGD's error-feedback memory and step counter are not checkpointed: a resumed run restarts its
warm-up, so a resume with `powersgd` is not bit-identical to an uninterrupted run.

DDP refuses torch's `bf16_compress_hook` by its name unless NCCL >= 2.10 is present, which also
rules out gloo, although gloo all-reduces bf16 correctly. `bf16_hook` is the same hook under another
name; on CUDA we make the NCCL check ourselves.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket
# and torch.futures.Future at runtime, and would see strings.
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported

COMM_HOOKS = ("none", "bf16", "powersgd")


def wrap_ddp(model: nn.Module, env: DistEnv, comm_hook: str) -> DistributedDataParallel:
    """`model` in DDP, with the named communication hook registered."""
    device_ids = [env.device.index] if env.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    if comm_hook == "bf16":
        if env.device.type == "cuda" and torch.cuda.nccl.version() < (2, 10):
            raise Unsupported("strategies.comm_hook: bf16 needs NCCL >= 2.10; set strategies.comm_hook=none")
        ddp.register_comm_hook(state=None, hook=bf16_hook)
    elif comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
        ddp.register_comm_hook(state=state, hook=powerSGD_hook.powerSGD_hook)
    else:
        assert comm_hook == "none", comm_hook
    return ddp


def bf16_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` (cast to bf16, divide by the world size, all-reduce, cast back)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)
