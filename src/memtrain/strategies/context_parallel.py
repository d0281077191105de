"""Context parallelism (`strategies.mesh.cp`): each rank of a context-parallel group holds a contiguous
1/cp of every row's tokens, and attention runs as a ring over the group (torch's context-parallel SDPA,
`torch.distributed.tensor.experimental`), on CUDA: torch has no ring for the CPU attention kernel.

Why the rows are split before the micro-steps (`split_sequence`), not inside torch's `context_parallel`
(which shards its buffers in place around the forward): every per-rank quantity (the token count that
normalises the loss, the summed loss, step 1's expected tokens) is then the rank's own, summed over the
data-parallel and context-parallel ranks like any data-parallel rank's (`MeshShape.batch_copies` leaves cp
out); the labels are already shifted (`causal_lm.data.collate`), so no target crosses a shard's edge.

Why contiguous shards with explicit position ids, not torch's head-tail load balancing: a Hugging Face model
takes its rotary positions from `position_ids`, and position ids that do not step by one mean packed
documents to it, for which it builds an explicit mask that the ring cannot take. Contiguous shards keep
them steps of one from the shard's offset, so the model calls SDPA with `is_causal` alone, which the ring
runs causally across the shards. The price: the causal ring's work is unbalanced (the first shard attends
to the fewest keys). Packed rows (`data.packing`, documents masked by their position ids) are refused.

Why FSDP over dp_shard x cp (`fsdp2.data_parallel_mesh`): the context-parallel ranks hold the same
parameters and compute the gradients of different tokens, so their gradients are reduced (and their
states sharded) with the data-parallel ranks'; the backend's averaging is undone over all of them
(`grad_sync_scale`).

Not run on a GPU yet (issue 29): the ring itself is torch's, checked on CPU only through a stand-in
(tests/parallel/ring_standin.py) that gathers the keys and values. scripts/gpu_check.sh runs torch's ring on
the CUDA kernels over a one-rank mesh (tests/strategies/test_context_parallel.py); two ranks need two GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from memtrain.errors import MemtrainError, RecipeError
from memtrain.strategies.tensor_parallel import vocabulary_parallel_loss

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from memtrain.distributed import DistEnv

Batch = dict[str, torch.Tensor]
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids")  # split along the columns; the rest stays whole
RING_ATTENTION_DEVICES = ("cuda",)  # devices whose attention kernels torch's ring dispatches


def split_sequence(batch: Batch, rank: int, ranks: int) -> Batch:
    """`rank`'s contiguous 1/`ranks` of every row's columns, with the position ids of those columns (from the
    shard's offset); the batch's width must divide (`causal_lm.data.trim_padding` pads to a multiple)."""
    if ranks == 1:
        return batch
    if "position_ids" in batch:
        raise RecipeError(
            [
                "data.packing: packed rows mask attention per document through their position ids, which "
                "context parallelism cannot run (its ring attends causally over the whole row); set "
                "data.packing: false or strategies.mesh.cp: 1"
            ]
        )
    rows, width = batch["input_ids"].shape
    if width % ranks:
        raise ValueError(f"a micro-batch of {width} columns does not split over {ranks} context ranks")
    share = width // ranks
    columns = slice(rank * share, (rank + 1) * share)
    positions = torch.arange(columns.start, columns.stop, device=batch["input_ids"].device)
    split = {k: (v[:, columns].contiguous() if k in SEQUENCE_KEYS else v) for k, v in batch.items()}
    split["position_ids"] = positions.expand(rows, share).contiguous()
    return split


def rank_share(batch: Batch, env: DistEnv) -> Batch:
    """This rank's share of a micro-batch under `strategies.mesh.cp > 1` (the batch itself without): a
    contiguous 1/cp of the columns of `input_ids` and `labels`, with the `position_ids` of those columns (the
    model's rotary positions), the other keys whole. `Trainer.context_parallel_split`'s default."""
    shape = env.shape
    if shape.cp == 1:
        return batch
    if "input_ids" not in batch or "labels" not in batch:
        raise MemtrainError(
            "strategies.mesh.cp: the batch has no 'input_ids' and 'labels' to split over the context-parallel "
            "ranks; override Trainer.context_parallel_split or set strategies.mesh.cp: 1"
        )
    return split_sequence(batch, shape.coordinates(env.rank)["cp"], shape.cp)


@contextlib.contextmanager
def parallel_loss(env: DistEnv) -> Iterator[None]:
    """A micro-step's forward and backward on `env`'s mesh: the loss on vocabulary-parallel logits over tp
    (`tensor_parallel.vocabulary_parallel_loss`), attention as the ring over cp; nothing without them."""
    with vocabulary_parallel_loss(env), ring_attention(env):
        yield


@contextlib.contextmanager
def ring_attention(env: DistEnv) -> Iterator[None]:
    """Within it (one micro-step's forward and backward), `torch.nn.functional.scaled_dot_product_attention`
    runs as torch's ring over the context-parallel group; a no-op without context parallelism."""
    if env.shape.cp == 1:
        yield
        return
    assert env.device_mesh is not None, "apply_strategies builds the run's device mesh"
    with _torch_ring(env.device_mesh["cp"]):
        yield


@contextlib.contextmanager
def _torch_ring(mesh: DeviceMesh) -> Iterator[None]:
    """torch's context-parallel SDPA dispatcher over `mesh`, without its load balancing (module docstring).
    Experimental in torch: the entry points are private, so a torch that moved them fails here by name."""
    from torch.distributed.tensor.experimental import _context_parallel as cp

    options = cp._attention._cp_options
    balanced = options.enable_load_balance
    options.enable_load_balance = False
    cp._attention._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    try:
        yield
    finally:
        cp._attention._disable_context_parallel_dispatcher_impl()
        options.enable_load_balance = balanced
