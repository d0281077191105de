"""Optimizer-state strategy: byte estimates against real optimizers, numerics against torch's AdamW.

The planner trusts `OptimizerStates.estimate` to the byte, so every CPU-available name is checked
against the storages a real optimizer holds after a step on a tiny llama whose tensors sit below, at
and above bitsandbytes' 8-bit threshold (4096 elements). The bf16 variant is checked op for op
against `torch.optim.AdamW`, and its stochastic rounding against the failure it exists to prevent.
"""

from __future__ import annotations

import copy
import io
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.errors import Unsupported
from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo
from memtrain.strategies.lowbit_adamw import BF16StateAdamW, round_stochastic_
from memtrain.strategies.optimizer import OPTIMIZER_STATES, measured_state_bytes
from memtrain.strategies.registry import DeviceFacts

from helpers import one_device_levels

VOCAB = 300
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}
HPARAMS: dict[str, Any] = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
CPU = DeviceFacts("cpu")
STEPS = 30
# Largest |loss(bf16 states) - loss(fp32 states)| allowed over the 30 steps (measured: 5e-4).
BF16_LOSS_TOLERANCE = 1e-2
# How far (nats) the mean loss of the last 5 steps must fall below that of the first 5 (measured: 0.8).
MIN_LOSS_DROP = 0.5


def tiny_llama(seed: int = 0, **overrides: Any) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **(TINY | overrides)))


def shape_of(model: nn.Module) -> ModelShape:
    params = tuple(ParamInfo(name, p.numel(), None) for name, p in model.named_parameters())
    return ModelShape(params, num_blocks=model.config.num_hidden_layers)


def arithmetic_batch(generator: torch.Generator, batch: int = 8, seq: int = 16) -> torch.Tensor:
    """Sequences (a + k·t) mod V: learnable from context, so a working optimizer lowers the loss."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    stride = torch.randint(1, 8, (batch, 1), generator=generator)
    return (start + stride * torch.arange(seq)) % VOCAB


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    return [train_step(model, optimizer, arithmetic_batch(generator)) for _ in range(steps)]


@pytest.fixture(scope="module")
def loss_curves() -> dict[str, list[float]]:
    """30-step loss curves from one initialisation and one data stream, per optimizer-state name."""
    base = tiny_llama()
    curves = {}
    for name in ("fp32", "bf16", "8bit"):
        model = copy.deepcopy(base)
        curves[name] = train(model, OPTIMIZER_STATES.create(name).build(model.parameters(), **HPARAMS), STEPS)
    return curves


def test_estimate_by_hand() -> None:
    shape = ModelShape(
        (ParamInfo("norm", 4095, None), ParamInfo("q", 4096, 0), ParamInfo("mlp", 10_000, 0)), num_blocks=1
    )
    numel = 4095 + 4096 + 10_000
    start = Footprint(weights=7, gradients=5, optimizer_states=999, activations=3, other=1)

    def states(name: str, param_bytes: int = 4) -> int:
        out = OPTIMIZER_STATES.create(name).estimate(shape, start, param_bytes)
        assert out.with_(optimizer_states=999) == start  # only the optimizer component changes
        return out.optimizer_states - 999  # added to what was there (e.g. a master copy)

    assert states("fp32") == 2 * 4 * numel + 3 * 4
    assert states("fp32", param_bytes=2) == 2 * 2 * numel + 3 * 4
    assert states("bf16") == states("bf16", param_bytes=2) == 2 * 2 * numel
    # 4095 elements stay fp32; 4096 -> 16 absmax blocks, 10000 -> 40 (the last one partial); shared qmaps
    eight_bit = 2 * 4 * 4095 + (2 * 4096 + 2 * 16 * 4) + (2 * 10_000 + 2 * 40 * 4) + 2 * 256 * 4
    assert states("8bit") == states("8bit", param_bytes=2) == states("paged-8bit") == eight_bit
    small_only = ModelShape((ParamInfo("norm", 64, None),), num_blocks=0)
    assert OPTIMIZER_STATES.create("8bit").estimate(small_only, Footprint()).optimizer_states == 2 * 4 * 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-params", "bf16-params"])
@pytest.mark.parametrize("name", ["fp32", "bf16", "8bit"])
def test_estimate_equals_measured_after_one_step(name: str, dtype: torch.dtype) -> None:
    model = tiny_llama().to(dtype)
    sizes = {p.numel() for p in model.parameters()}
    assert min(sizes) < 4096 <= max(sizes) and 4096 in sizes  # both sides of the 8-bit threshold
    strategy = OPTIMIZER_STATES.create(name)
    optimizer = strategy.build(model.parameters(), **HPARAMS)
    assert measured_state_bytes(optimizer) == 0  # states are created lazily by the first step
    train_step(model, optimizer, arithmetic_batch(torch.Generator().manual_seed(0)))
    estimate = strategy.estimate(shape_of(model), Footprint(), param_bytes=dtype.itemsize)
    assert estimate.optimizer_states == measured_state_bytes(optimizer)


def test_8bit_keeps_about_two_bytes_per_param_on_large_tensors() -> None:
    model = tiny_llama(hidden_size=128, intermediate_size=344, num_key_value_heads=4, vocab_size=512)
    shape = shape_of(model)
    assert sum(p.numel for p in shape.params if p.numel < 4096) / shape.numel < 0.01
    optimizer = OPTIMIZER_STATES.create("8bit").build(model.parameters(), **HPARAMS)
    train_step(model, optimizer, arithmetic_batch(torch.Generator().manual_seed(0)))
    measured = measured_state_bytes(optimizer)
    assert 2.0 <= measured / shape.numel <= 2.2
    assert OPTIMIZER_STATES.create("8bit").estimate(shape, Footprint()).optimizer_states == measured


def loss_drop(curve: list[float]) -> float:
    return sum(curve[:5]) / 5 - sum(curve[-5:]) / 5


def test_8bit_loss_falls(loss_curves: dict[str, list[float]]) -> None:
    assert loss_drop(loss_curves["8bit"]) > MIN_LOSS_DROP, loss_curves["8bit"]


def test_bf16_states_track_fp32_loss(loss_curves: dict[str, list[float]]) -> None:
    fp32, bf16 = loss_curves["fp32"], loss_curves["bf16"]
    assert loss_drop(fp32) > MIN_LOSS_DROP  # the comparison means something only if training moves
    assert max(abs(a - b) for a, b in zip(fp32, bf16, strict=True)) < BF16_LOSS_TOLERANCE


def test_bf16_one_step_equals_torch_adamw_up_to_state_rounding() -> None:
    model = tiny_llama()
    reference = copy.deepcopy(model)
    ids = arithmetic_batch(torch.Generator().manual_seed(0))
    ours = OPTIMIZER_STATES.create("bf16").build(model.parameters(), **HPARAMS)
    theirs = torch.optim.AdamW(reference.parameters(), foreach=False, **HPARAMS)
    train_step(model, ours, ids)
    train_step(reference, theirs, ids)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, r)  # the update uses the moments before they are rounded for storage
        for key in ("exp_avg", "exp_avg_sq"):
            stored, exact = ours.state[p][key], theirs.state[r][key]
            assert stored.dtype == torch.bfloat16
            # stochastic rounding lands on one of the two neighbouring bf16 values: within one ulp
            torch.testing.assert_close(stored.float(), exact, rtol=2**-7, atol=0)


def test_fp32_storage_equals_torch_adamw_exactly() -> None:
    model = tiny_llama()
    reference = copy.deepcopy(model)
    hparams = HPARAMS | {"weight_decay": 0.1}  # large enough that a coupled decay would show
    # chunk_numel=1000 also proves that updating large tensors in flat chunks changes nothing
    ours = BF16StateAdamW(model.parameters(), state_dtype=torch.float32, chunk_numel=1000, **hparams)
    theirs = torch.optim.AdamW(reference.parameters(), foreach=False, **hparams)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # several steps, so bias correction is exercised beyond step 1
        ids = arithmetic_batch(generator)
        train_step(model, ours, ids)
        train_step(reference, theirs, ids)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, r)
        assert torch.equal(ours.state[p]["exp_avg"], theirs.state[r]["exp_avg"])
        assert torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[r]["exp_avg_sq"])
        assert ours.state[p]["step"] == int(theirs.state[r]["step"]) == 3


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_stochastic_rounding_lets_the_second_moment_decay(stochastic: bool) -> None:
    """beta2=0.999 shrinks exp_avg_sq by 0.1% a step, under half a bf16 ulp: nearest rounding stalls it."""
    param = nn.Parameter(torch.zeros(4096))
    hparams = HPARAMS | {"weight_decay": 0.0}
    if stochastic:  # what the strategy builds
        optimizer = OPTIMIZER_STATES.create("bf16").build([param], **hparams)
    else:
        optimizer = BF16StateAdamW([param], stochastic_rounding=False, **hparams)
    param.grad = torch.ones(4096)
    optimizer.step()  # exp_avg_sq = 0.001
    param.grad = torch.zeros(4096)
    for _ in range(200):
        optimizer.step()
    mean = float(optimizer.state[param]["exp_avg_sq"].float().mean())
    if stochastic:
        assert mean == pytest.approx(1e-3 * 0.999**200, rel=0.01)
    else:
        assert mean == float(torch.tensor(1e-3).bfloat16())  # never moved


def test_stochastic_rounding_is_unbiased_and_keeps_representable_values() -> None:
    generator = torch.Generator().manual_seed(0)
    representable = torch.randn(1 << 20).bfloat16().float()
    out = torch.empty(1 << 20, dtype=torch.bfloat16)
    round_stochastic_(out, representable, generator)
    assert torch.equal(out.float(), representable)
    # 1 + 2^-9 lies a quarter of the way from 1 to the next bf16 value, 1 + 2^-7
    quarter = torch.cat([torch.full((1 << 16,), 1 + 2**-9), torch.full((1 << 16,), -(1 + 2**-9))])
    out = torch.empty_like(quarter, dtype=torch.bfloat16)
    round_stochastic_(out, quarter, generator)
    assert set(out.float().abs().unique().tolist()) == {1.0, 1 + 2**-7}
    up = (out.float().abs() > 1).float()
    assert float(up[: 1 << 16].mean()) == pytest.approx(0.25, abs=0.01)  # positive values
    assert float(up[1 << 16 :].mean()) == pytest.approx(0.25, abs=0.01)  # negative values, by magnitude


def test_bf16_updates_dtensor_parameters_through_their_shards() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight, grad = torch.randn(64, 48), torch.randn(64, 48)
        plain = nn.Parameter(weight.clone())
        plain.grad = grad.clone()
        sharded = nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        plain_opt, sharded_opt = BF16StateAdamW([plain]), BF16StateAdamW([sharded])
        for _ in range(3):
            plain_opt.step()
            sharded_opt.step()
        assert torch.equal(plain.detach(), sharded.detach().to_local())
        assert measured_state_bytes(sharded_opt) == measured_state_bytes(plain_opt) == 2 * 2 * 64 * 48
    finally:
        dist.destroy_process_group()


def test_check_on_cpu() -> None:
    for name in ("fp32", "bf16", "8bit"):
        OPTIMIZER_STATES.create(name).check(CPU)
    with pytest.raises(
        Unsupported, match=r"paged-8bit needs CUDA.*use 8bit or fp32 \(strategies\.optimizer_states\)"
    ):
        OPTIMIZER_STATES.create("paged-8bit").check(CPU)


def test_missing_bitsandbytes_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    for name in ("8bit", "paged-8bit"):
        with pytest.raises(Unsupported, match=r"pip install 'memtrain\[bnb\]'"):
            OPTIMIZER_STATES.create(name).check(DeviceFacts("cuda"))
        with pytest.raises(Unsupported, match=r"memtrain\[bnb\]"):
            OPTIMIZER_STATES.create(name).build([nn.Parameter(torch.zeros(1))], **HPARAMS)
    OPTIMIZER_STATES.create("fp32").check(CPU)
    OPTIMIZER_STATES.create("bf16").check(CPU)


def test_unknown_name_names_the_choices() -> None:
    with pytest.raises(Unsupported, match=r'strategies\.optimizer_states.*did you mean "8bit"'):
        OPTIMIZER_STATES.create("8-bit")


@pytest.mark.parametrize("name", ["fp32", "bf16", "8bit"])
def test_state_dict_round_trip_with_weights_only_load(name: str) -> None:
    strategy = OPTIMIZER_STATES.create(name)
    model = tiny_llama()
    optimizer = strategy.build(model.parameters(), **HPARAMS)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        train_step(model, optimizer, arithmetic_batch(generator))
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    restored_model = copy.deepcopy(model)
    restored = strategy.build(restored_model.parameters(), **HPARAMS)
    restored.load_state_dict(torch.load(buffer, weights_only=True))

    def layout(opt: torch.optim.Optimizer) -> list[tuple[str, torch.dtype, torch.Size]]:
        return [(k, v.dtype, v.shape) for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)]

    # e.g. bf16 moments must not come back upcast to the parameter dtype
    assert layout(restored) == layout(optimizer)
    assert measured_state_bytes(restored) == strategy.estimate(shape_of(model), Footprint()).optimizer_states
    ids = arithmetic_batch(generator)
    train_step(model, optimizer, ids)
    train_step(restored_model, restored, ids)
    for p, r in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(p, r)  # the next step continues exactly where the saved run would have


def test_measured_state_bytes_counts_each_storage_once() -> None:
    param = nn.Parameter(torch.zeros(10))
    optimizer = torch.optim.SGD([param], lr=0.1)
    shared = torch.zeros(100)  # 400 bytes
    optimizer.state[param] = {
        "a": shared,
        "b": shared[:10],
        "c": torch.zeros(3, dtype=torch.bfloat16),
        "n": 7,
    }
    assert measured_state_bytes(optimizer) == 400 + 6


def test_fp32_states_are_torch_fused_adamw_and_train_as_its_foreach_path() -> None:
    """`fp32` builds torch's fused AdamW (no foreach copy of all parameters): the same update as torch's
    multi-tensor and single-tensor AdamW up to float rounding (another kernel, another order of operations),
    so the losses of 10 steps agree to 1e-5 (measured: 1.4e-6) and the weights to 1e-5 (1.6e-7)."""
    base = tiny_llama()
    models = {path: copy.deepcopy(base) for path in ("fused", "foreach", "single")}
    fused = OPTIMIZER_STATES.create("fp32").build(models["fused"].parameters(), **HPARAMS)
    assert all(group["fused"] for group in fused.param_groups)
    optimizers = {
        "fused": fused,
        "foreach": torch.optim.AdamW(models["foreach"].parameters(), foreach=True, **HPARAMS),
        "single": torch.optim.AdamW(models["single"].parameters(), foreach=False, **HPARAMS),
    }
    losses = {path: train(models[path], optimizers[path], 10) for path in models}
    assert losses["fused"][-1] < losses["fused"][0] - 0.1  # the steps move the weights (measured: -0.22)
    for other in ("foreach", "single"):
        assert losses["fused"] == pytest.approx(losses[other], abs=1e-5)
        for a, b in zip(models["fused"].parameters(), models[other].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_falls_back_where_torch_has_no_fused_kernel() -> None:
    """Parameters torch's fused AdamW refuses (at the first step: here a meta tensor) get its default path."""
    on_meta = [nn.Parameter(torch.zeros(4, device="meta"))]
    optimizer = OPTIMIZER_STATES.create("fp32").build(on_meta, **HPARAMS)
    assert not optimizer.param_groups[0]["fused"]


FSDP2_FUSED = """
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from memtrain.strategies.optimizer import OPTIMIZER_STATES
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.manual_seed(0)
models = [nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)) for _ in range(2)]
models[1].load_state_dict(models[0].state_dict())
for m in models:
    fully_shard(m)
fused = OPTIMIZER_STATES.create("fp32").build(models[0].parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                              weight_decay=0.01)
foreach = torch.optim.AdamW(models[1].parameters(), lr=1e-2, foreach=True)
assert fused.param_groups[0]["fused"] and type(next(models[0].parameters())).__name__ == "DTensor"
x = torch.randn(8, 16)
for _ in range(3):
    for m, o in zip(models, (fused, foreach)):
        m(x).square().mean().backward(); o.step(); o.zero_grad()
gap = max((a.full_tensor() - b.full_tensor()).abs().max().item()
          for a, b in zip(models[0].parameters(), models[1].parameters()))
assert gap < 1e-6, gap
# plain parameters beside distributed ones (torch's fused kernel refuses them at the first step: "got mixed
# torch.Tensor and DTensor"), and a 2-D mesh (HSDP; fused untested on several ranks) take the default path
from torch.distributed.device_mesh import init_device_mesh
hsdp = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
mixed = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
fully_shard(mixed[0])
for m in (hsdp, mixed):
    o = OPTIMIZER_STATES.create("fp32").build(m.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                              weight_decay=0.01)
    assert not o.param_groups[0]["fused"], m
    m(x).square().mean().backward(); o.step(); o.zero_grad()
dist.destroy_process_group()
print("ok")
"""


def test_fused_adamw_steps_fsdp2_dtensor_parameters() -> None:
    """FSDP2's parameters are DTensors: torch's fused AdamW steps them (DTensor dispatches the fused kernel to
    the local shards), as its foreach path does (one rank; a process of its own for the process group). Plain
    parameters beside DTensors (which fused refuses) and a 2-D mesh take the default path, and step."""
    import socket
    import subprocess

    from helpers import REPO, subprocess_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-c", FSDP2_FUSED.format(port=port)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_paged_states_are_outside_the_device_levels() -> None:
    """`paged-8bit`: the uint8 moments of tensors of at least bitsandbytes' paging threshold live in CUDA
    unified memory (outside torch's allocator, evicted rather than failing): the planner's device levels
    leave them out and holds them as `paged`; the rest (absmax blocks, maps, smaller tensors) stays on the
    device. The threshold is read against bitsandbytes' own `get_state_buffer`."""
    import inspect

    import bitsandbytes

    from memtrain.strategies.optimizer import BNB_MIN_PAGED_SIZE
    from memtrain.strategies.precision import PRECISION

    source = inspect.getsource(bitsandbytes.optim.optimizer.Optimizer8bit.get_state_buffer)
    assert f"p.numel() < {BNB_MIN_PAGED_SIZE:.0e}".replace("+0", "") in source, source
    shape = ModelShape(
        tuple(ParamInfo(f"p{n}", n, None) for n in (1000, 5000, BNB_MIN_PAGED_SIZE - 1, BNB_MIN_PAGED_SIZE)),
        num_blocks=1,
    )

    def levels(name: str) -> Any:
        return one_device_levels(shape, PRECISION.create("bf16-true"), OPTIMIZER_STATES.create(name))

    paged, plain = levels("paged-8bit"), levels("8bit")
    assert paged.paged == 2 * BNB_MIN_PAGED_SIZE and plain.paged == 0
    assert paged.optimizer_states + paged.paged == plain.optimizer_states
    assert paged.stored == plain.stored  # a checkpoint holds them all
