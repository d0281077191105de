"""`split_sequence`: a context-parallel rank's contiguous columns of a micro-batch, with their positions.
(The split trained against one process: tests/parallel/test_mesh.py, the fsdp_x_cp job.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from memtrain.errors import RecipeError
from memtrain.strategies.context_parallel import split_sequence

from helpers import TINY_LLAMA


def test_each_rank_gets_its_columns_and_their_positions() -> None:
    batch = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "labels": torch.arange(100, 116).reshape(2, 8),
        "sample_ids": torch.tensor([5, 9]),
    }
    parts = [split_sequence(batch, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], dim=1), batch["input_ids"])
    assert torch.equal(torch.cat([p["labels"] for p in parts], dim=1), batch["labels"])
    assert parts[2]["position_ids"].tolist() == [[4, 5], [4, 5]]  # steps of one from the shard's offset
    assert all(torch.equal(p["sample_ids"], batch["sample_ids"]) for p in parts)  # per row: whole
    assert split_sequence(batch, 0, 1) is batch


def test_packed_rows_and_uneven_widths_are_refused() -> None:
    packed = {"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8), "position_ids": torch.zeros(1, 8)}
    with pytest.raises(RecipeError, match="data.packing"):
        split_sequence(packed, 0, 2)
    with pytest.raises(ValueError, match="does not split over 3"):
        split_sequence({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8)}, 0, 3)


def test_the_ring_is_torchs_context_parallel_sdpa() -> None:
    # The contract with torch's experimental API (private entry points): inside the context SDPA is torch's
    # context-parallel dispatch, which on this CPU stops at the CPU kernel it has no ring for (the reason a
    # CPU run refuses cp before step 1), and both the function and the load balancing come back after.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from memtrain.distributed import one_process
    from memtrain.strategies.sharding.base import ensure_process_group

    ours = not dist.is_initialized()
    ensure_process_group(one_process())
    try:
        _check_the_ring(init_device_mesh("cpu", (1,), mesh_dim_names=("cp",)))
    finally:
        if ours:  # the next test in this process may start its own
            dist.destroy_process_group()


def _check_the_ring(mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from memtrain.strategies.context_parallel import _torch_ring

    original = torch.nn.functional.scaled_dot_product_attention
    balanced = _attention._cp_options.enable_load_balance
    query = torch.randn(1, 2, 4, 8)
    with _torch_ring(mesh["cp"]):
        assert torch.nn.functional.scaled_dot_product_attention is not original
        assert _attention._cp_options.enable_load_balance is False  # contiguous shards (module docstring)
        with pytest.raises(NotImplementedError, match="_scaled_dot_product_flash_attention_for_cpu"):
            torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert torch.nn.functional.scaled_dot_product_attention is original
    assert _attention._cp_options.enable_load_balance is balanced


# A Hugging Face llama with grouped-query attention (4 query heads, 2 key-value heads, head_dim 16): its SDPA
# call passes `enable_gqa`, the first thing to watch under the ring (issue 29).
GQA_LLAMA = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128}


def _loss_and_grads(
    model: torch.nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), grads


def _ring_against_plain(
    device: str, dtype: torch.dtype, ring: Callable[[DeviceMesh], Any], tolerance: float
) -> None:
    """One forward and backward of `GQA_LLAMA` with SDPA as it is and inside `ring` over a one-rank cp mesh
    on `device`: the same loss and gradients (a one-rank ring is the plain attention, through other code)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from memtrain.distributed import DistEnv
    from memtrain.strategies.sharding.base import ensure_process_group

    torch.manual_seed(0)
    config = AutoConfig.for_model(**GQA_LLAMA)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype)
    ids = torch.randint(0, GQA_LLAMA["vocab_size"], (2, 32), device=device)
    plain_loss, plain_grads = _loss_and_grads(model, ids)
    ours = not dist.is_initialized()
    ensure_process_group(DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device(device)))
    try:
        with ring(init_device_mesh(device, (1,), mesh_dim_names=("cp",))["cp"]):
            ring_loss, ring_grads = _loss_and_grads(model, ids)
    finally:
        if ours:
            dist.destroy_process_group()
    assert torch.isfinite(ring_loss) and abs(ring_loss - plain_loss) <= tolerance * plain_loss, (
        ring_loss,
        plain_loss,
    )
    assert ring_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        error = (ring_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error <= tolerance, (name, float(error))


def test_the_gpu_ring_check_runs_on_cpu_through_the_standin() -> None:
    # The CUDA test below, dry: the same model, mesh and comparison with the CPU stand-in as the ring (which
    # attends with an explicit causal mask over gathered keys: the same numbers, another code path).
    from parallel.ring_standin import SEEN, gathered_ring

    SEEN.clear()
    _ring_against_plain("cpu", torch.float32, gathered_ring, tolerance=1e-5)
    assert SEEN == {(32, 32)}, "the stand-in attended the row's 32 queries to its 32 keys"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"]
)
def test_torchs_ring_runs_a_gqa_model_on_cuda(
    dtype: torch.dtype, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's ring over a one-rank mesh on the real CUDA kernels: the forward and backward attention of every
    # layer go through its ring ops (flash in bf16; efficient or flash in fp32), with HF's `enable_gqa`.
    from torch.distributed.tensor.experimental._context_parallel import _attention

    from memtrain.strategies.context_parallel import _torch_ring

    calls: list[str] = []
    for name in dir(_attention):
        if name.startswith("_scaled_dot_product_ring_"):
            monkeypatch.setattr(_attention, name, _counted(getattr(_attention, name), name, calls))
    _ring_against_plain("cuda", dtype, _torch_ring, tolerance)
    layers = GQA_LLAMA["num_hidden_layers"]
    forward = [c for c in calls if not c.endswith("_backward")]
    assert len(forward) == layers and len(calls) == 2 * layers, calls


def _counted(function: Callable[..., Any], name: str, calls: list[str]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return function(*args, **kwargs)

    return counted
