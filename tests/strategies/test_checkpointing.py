"""Activation checkpointing: exact numerics, the recompute it costs, the bytes it saves, and the estimate.

Two models: a tiny transformers llama (blocks called with keyword arguments: rotary tables, masks, a KV
cache) and a hand-written transformer with a ModuleList of blocks (its own attention, dropout, big local
intermediates). Every mode must reproduce `none`'s losses and gradients bit for bit in fp32; FLOP counts
show what was recomputed; `ActivationPeak` (below) measures the peak activation bytes each mode really
has, independently of `profile_activations` (which sees what autograd saves, not what is alive), and
`Checkpointing.estimate` from a `none` profile must land within 10% of it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from memtrain.errors import Unsupported
from memtrain.memory.activation_profile import profile_activations
from memtrain.memory.footprint import ActivationProfile, Footprint
from memtrain.strategies import checkpointing as ckpt_module
from memtrain.strategies.blocks import discover_blocks
from memtrain.strategies.checkpointing import CHECKPOINTING, Checkpointing, FractionCheckpointing
from memtrain.strategies.registry import DeviceFacts

MODES = [
    CHECKPOINTING.create("full"),
    FractionCheckpointing(0.5),
    CHECKPOINTING.create("selective"),
    CHECKPOINTING.create("offload"),
]
ALL_MODES = [CHECKPOINTING.create("none"), *MODES]
ESTIMATE_TOLERANCE = 0.10  # measured worst case: 3.2% (offload on the hand-written model)


# ----------------------------------------------------------------------------------------------- models


def tiny_llama(layers: int = 4, hidden: int = 64, positions: int = 64, attention: str = "sdpa") -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=positions,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention)


class PlainBlock(nn.Module):
    """A pre-norm block as a user writes it: attention by hand (bmm, softmax), a GELU MLP, dropout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads) + mask
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.dropout(self.proj(attn))
        return x + self.dropout(self.down(F.gelu(self.up(self.norm2(x)))))


class PlainNet(nn.Module):
    vocab = 96

    def __init__(self, dim: int = 32, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, dim)
        self.blocks = nn.ModuleList([PlainBlock(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, self.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(self.norm(x))


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": tiny_llama, "plain": PlainNet}


def build(name: str, strategy: Checkpointing, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]()
    model.train()
    strategy.apply(model, discover_blocks(model))
    return model


def ids_for(name: str, batch: int = 4, seq: int = 32) -> torch.Tensor:
    vocab = PlainNet.vocab if name == "plain" else 128
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def loss_of(model: nn.Module, ids: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
    """Next-token cross entropy on fp32 logits."""
    if isinstance(model, PlainNet):
        logits = model(ids)
    else:
        logits = model(input_ids=ids, **({"use_cache": False} | model_kwargs)).logits
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------- measuring the peak


class ActivationPeak(TorchDispatchMode):
    """Peak live bytes of storages created by the forward, or by a recompute in backward.

    Inside `with`: the forward, every storage an op allocates counts (a view or an in-place op allocates
    nothing) until it is released. Inside `backward()`: ops with grad mode off make gradients, not
    activations; ops with it on are a checkpoint's recompute and count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._backward = False
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def backward(self, loss: torch.Tensor) -> None:
        self._backward = True
        with self:
            loss.backward()

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._backward and not torch.is_grad_enabled():
            return out
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._refs or key in inputs or storage.nbytes() == 0:
                continue
            self._refs[key] = weakref.ref(storage, self._release(key, storage.nbytes()))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        return out

    def _release(self, key: int, nbytes: int) -> Callable[[object], None]:
        def release(_ref: object) -> None:
            self._refs.pop(key, None)
            self.live -= nbytes

        return release


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def measured_peak(model: nn.Module, ids: torch.Tensor) -> int:
    meter = ActivationPeak()
    with meter:
        loss = loss_of(model, ids)
    meter.backward(loss)
    return meter.peak


@pytest.fixture
def host_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make offload's host copies real copies the measurement does not see, as on a GPU.

    On a CPU the host is the device: `_to_host` keeps the tensor and offload saves nothing. With this the
    originals are released once their block ends (exactly as the CUDA path does after its copies), so the
    measured peak is what offload keeps on a device.
    """

    def to_host(_self: object, tensor: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            return tensor.clone()

    monkeypatch.setattr(ckpt_module._HostOffload, "_to_host", to_host)


def profile_of(name: str, ids: torch.Tensor) -> ActivationProfile:
    model = build(name, CHECKPOINTING.create("none"))
    return profile_activations(model, discover_blocks(model), lambda: loss_of(model, ids))


# ------------------------------------------------------------------------------------------ numerics


def train(
    name: str, strategy: Checkpointing, steps: int = 3
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    model = build(name, strategy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = ids_for(name)
    torch.manual_seed(5)  # the dropout masks
    losses, grads = [], []
    for _ in range(steps):
        loss = loss_of(model, ids)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.mark.parametrize("name", MODELS)
def test_every_mode_is_bit_identical_to_none(name: str) -> None:
    ref_losses, ref_grads = train(name, CHECKPOINTING.create("none"))
    for strategy in MODES:
        losses, grads = train(name, strategy)
        for step, (a, b) in enumerate(zip(ref_losses, losses, strict=True)):
            assert torch.equal(a, b), f"{strategy}: loss differs at step {step}"
        for step, (ga, gb) in enumerate(zip(ref_grads, grads, strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True)), (
                f"{strategy}: grads differ, step {step}"
            )


def test_checkpointed_llama_leaves_the_kv_cache_alone() -> None:
    """With use_cache=True (llama's config default) a recompute would append keys and values again.

    Causal attention over the doubled cache still gives the same gradients, so only the cache shows it.
    """
    ids = ids_for("llama")
    results = []
    for strategy in (CHECKPOINTING.create("none"), CHECKPOINTING.create("full")):
        model = build("llama", strategy)
        out = model(input_ids=ids, use_cache=True)
        cached = out.past_key_values.get_seq_length()
        out.logits.float().square().mean().backward()
        assert out.past_key_values.get_seq_length() == cached, f"{strategy}: backward changed the cache"
        results.append((out.logits.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


# ------------------------------------------------------------------------------------------ recompute

_POINTWISE = [
    getattr(torch.ops.aten, op)
    for op in ("mul", "add", "sub", "div", "pow", "rsqrt", "mean", "silu", "gelu", "neg", "_softmax", "cat")
]


def _elementwise(*_args: Any, out_shape: Any = None, **_kwargs: Any) -> int:
    return math.prod(out_shape)


def flops(name: str, strategy: Checkpointing, pointwise: bool = False) -> int:
    model = build(name, strategy)
    mapping = {op: _elementwise for op in _POINTWISE} if pointwise else None
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        loss_of(model, ids_for(name)).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", MODELS)
def test_flops_show_the_recompute(name: str) -> None:
    model = build(name, CHECKPOINTING.create("none"))
    with FlopCounterMode(display=False) as counter:
        loss_of(model, ids_for(name))
    blocks = discover_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    prefix = type(model).__name__
    block_forward = sum(sum(counter.get_flop_counts()[f"{prefix}.{names[id(b)]}"].values()) for b in blocks)

    none, full, fraction = (
        flops(name, CHECKPOINTING.create(n, {"checkpointing_fraction": f}))
        for n, f in [("none", 1), ("full", 1), ("fraction", 0.5)]
    )
    # One more forward of the blocks, less the tail after each block's last saved tensor (non-reentrant
    # checkpoint stops recomputing there: llama's down projection, whose output nobody saves).
    assert 0.7 * block_forward <= full - none <= block_forward
    share = FractionCheckpointing(0.5).checkpointed(len(blocks)).count(True) / len(blocks)
    assert fraction - none == pytest.approx(share * (full - none), rel=1e-6)
    assert flops(name, CHECKPOINTING.create("selective")) == none, "selective keeps every matmul output"
    assert flops(name, CHECKPOINTING.create("offload")) == none
    counted = {n: flops(name, CHECKPOINTING.create(n), pointwise=True) for n in ("none", "selective", "full")}
    assert counted["none"] < counted["selective"] < counted["full"], counted


# ---------------------------------------------------------------------------------------------- bytes


@pytest.fixture(scope="module")
def wide_llama_peaks() -> dict[str, int]:
    """Peak activation bytes of a 12-block llama where activations dominate (hidden 128, 4 x 128 tokens)."""
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1))
    peaks = {}
    for strategy in (
        CHECKPOINTING.create("none"),
        CHECKPOINTING.create("full"),
        FractionCheckpointing(0.5),
        CHECKPOINTING.create("selective"),
    ):
        torch.manual_seed(0)
        model = tiny_llama(layers=12, hidden=128, positions=128)
        strategy.apply(model, discover_blocks(model))
        peaks[strategy.name] = measured_peak(model, ids)
    return peaks


def test_measured_savings_on_twelve_blocks(wide_llama_peaks: dict[str, int]) -> None:
    none, full = wide_llama_peaks["none"], wide_llama_peaks["full"]
    fraction, selective = wide_llama_peaks["fraction"], wide_llama_peaks["selective"]
    assert full <= 0.2 * none, wide_llama_peaks
    assert full < fraction < none
    assert fraction == pytest.approx((none + full) / 2, rel=0.1), "checkpointing half the blocks saves half"
    assert full < selective < none


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("strategy", ALL_MODES, ids=lambda s: s.name)
def test_estimate_matches_measurement(
    name: str, strategy: Checkpointing, request: pytest.FixtureRequest
) -> None:
    if strategy.name == "offload":
        request.getfixturevalue("host_elsewhere")
    ids = ids_for(name)
    estimate = strategy.estimate(profile_of(name, ids), Footprint(weights=7)).activations
    measured = measured_peak(build(name, strategy), ids)
    assert abs(estimate - measured) <= ESTIMATE_TOLERANCE * measured, (estimate, measured)


@pytest.mark.parametrize("name", MODELS)
def test_offload_on_cpu_runs_the_path_and_moves_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every activation a block saves reaches `_to_host`, no weight does; on a CPU that moves nothing."""
    ids = ids_for(name)
    offered: dict[int, int] = {}  # storage -> bytes, kept alive by `tensors`
    tensors: list[torch.Tensor] = []
    original = ckpt_module._HostOffload._to_host

    def recording(self: ckpt_module._HostOffload, tensor: torch.Tensor) -> torch.Tensor:
        tensors.append(tensor)
        offered[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        host = original(self, tensor)
        assert host is tensor, "on a CPU the host copy is the tensor itself"
        return host

    monkeypatch.setattr(ckpt_module._HostOffload, "_to_host", recording)
    model = build(name, CHECKPOINTING.create("offload"))
    peak = measured_peak(model, ids)
    assert not {id(p.untyped_storage()) for p in model.parameters()} & offered.keys(), "weights stay"
    assert sum(offered.values()) == sum(profile_of(name, ids).per_block)
    assert peak == measured_peak(build(name, CHECKPOINTING.create("none")), ids)


def test_profile_by_hand() -> None:
    """Two blocks of Linear(8, 8, no bias) + ReLU on a 4 x 8 input made inside the step; 128 B per tensor.

    Block 0's matmul saves x (its input; x needs no gradient, so the weight is not saved), its ReLU saves its
    output. Block 1's matmul saves that output again (already counted) and its weight (not an activation),
    its ReLU saves its output. Each block holds its matmul output and its ReLU output at once (the
    Sequential's loop variable); the loss's sum adds a 4-byte scalar outside the blocks.
    """
    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU()) for _ in range(2)])

    def step() -> torch.Tensor:
        x = torch.randn(4, 8)
        for block in blocks:
            x = block(x)
        return x.sum()

    trace = profile_activations(blocks, list(blocks), step)
    assert trace == ActivationProfile(
        per_block=(256, 128),
        block_inputs=(128, 128),
        matmul_outputs=(128, 128),
        outside_blocks=4,
        block_peaks=(256, 256),
        recompute_peaks=(256, 256),
    )
    assert all(p.grad is not None for p in blocks.parameters()), "the step was backpropagated"


def test_estimate_by_hand() -> None:
    """Two blocks: P saved, I inputs, M matmul outputs; O head side (no block peaks: F = R = P - I)."""
    profile = ActivationProfile(
        per_block=(100, 100), block_inputs=(10, 10), matmul_outputs=(40, 40), outside_blocks=30
    )
    base = Footprint(weights=5, gradients=5)

    def acts(strategy: Checkpointing) -> int:
        footprint = strategy.estimate(profile, base)
        assert footprint.with_(activations=0) == base
        return footprint.activations

    assert acts(CHECKPOINTING.create("none")) == 230  # 100 + 100 + 30
    assert (
        acts(CHECKPOINTING.create("full")) == 110
    )  # recompute of block 1 on top of both inputs: 10 + 10 + 90
    assert acts(FractionCheckpointing(0.5)) == 140  # 10 + 100 + 30: block 0's recompute comes later
    assert acts(CHECKPOINTING.create("selective")) == 150  # block 1 recomputed: 50 + max(50, 10 + 90)
    assert acts(CHECKPOINTING.create("offload")) == 110  # block 0's inputs stay: 10 + max(0, 10 + 90)


def test_fraction_checkpoints_the_first_blocks() -> None:
    assert FractionCheckpointing(0.5).checkpointed(12) == (True,) * 6 + (False,) * 6
    assert FractionCheckpointing(0.5).checkpointed(3) == (True, True, False)  # rounds half up
    assert FractionCheckpointing(1.0).checkpointed(4) == CHECKPOINTING.create("full").checkpointed(4)
    assert CHECKPOINTING.create("offload").checkpointed(4) == (False,) * 4


# --------------------------------------------------------------------------------- keys and errors


@pytest.mark.parametrize("strategy", ALL_MODES, ids=lambda s: s.name)
def test_state_dict_keys_are_unchanged(strategy: Checkpointing) -> None:
    for name in MODELS:
        plain = build(name, CHECKPOINTING.create("none"))
        wrapped = build(name, strategy)
        assert list(wrapped.state_dict()) == list(plain.state_dict())
        assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_full_checkpoint_loads_into_none_model() -> None:
    ids = ids_for("llama")
    trained = build("llama", CHECKPOINTING.create("full"))
    loss_of(trained, ids).backward()
    torch.optim.SGD(trained.parameters(), lr=0.1).step()
    fresh = build("llama", CHECKPOINTING.create("none"), seed=1)
    assert not torch.equal(loss_of(fresh, ids), loss_of(trained, ids))
    fresh.load_state_dict(trained.state_dict(), strict=True)
    assert torch.equal(loss_of(fresh, ids), loss_of(trained, ids))


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (FractionCheckpointing(0.0), "checkpointing_fraction: must be in (0, 1]"),
        (FractionCheckpointing(1.5), "checkpointing_fraction: must be in (0, 1]"),
        (FractionCheckpointing(float("nan")), "checkpointing_fraction: must be in (0, 1]"),
    ],
)
def test_check_rejects_what_cannot_run(strategy: Checkpointing, message: str) -> None:
    with pytest.raises(Unsupported, match=message.replace("(", r"\(").replace("]", r"\]")) as info:
        strategy.check(DeviceFacts("cpu"))
    assert str(info.value).startswith("strategies.checkpointing"), "the message names the recipe key"


def test_unknown_mode_names_the_key_and_the_registered_names() -> None:
    with pytest.raises(
        Unsupported, match='strategies.checkpointing: .selectve. is not one of .*did you mean "selective"'
    ):
        CHECKPOINTING.create("selectve")


def test_every_mode_runs_on_cpu_and_cuda_but_offload_needs_a_host_path() -> None:
    for strategy in ALL_MODES:
        strategy.check(DeviceFacts("cpu"))
        strategy.check(DeviceFacts("cuda"))
    with pytest.raises(Unsupported, match="offload is implemented for CUDA"):
        CHECKPOINTING.create("offload").check(DeviceFacts("mps"))
    CHECKPOINTING.create("full").check(DeviceFacts("mps"))


def test_apply_refuses_twice_and_foreign_blocks() -> None:
    model = build("plain", CHECKPOINTING.create("full"))
    with pytest.raises(ValueError, match="already wrapped"):
        CHECKPOINTING.create("selective").apply(model, discover_blocks(model))
    with pytest.raises(ValueError, match="not a submodule"):
        CHECKPOINTING.create("full").apply(PlainNet(), discover_blocks(model))


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_on_cuda_is_exact_and_keeps_activations_on_the_host() -> None:
    device = torch.device("cuda")
    ids = torch.randint(0, 128, (4, 128), generator=torch.Generator().manual_seed(1)).to(device)
    results = {}
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # eager attention: no atomics in backward
    try:
        for strategy in (CHECKPOINTING.create("none"), CHECKPOINTING.create("offload")):
            torch.manual_seed(0)
            model = tiny_llama(layers=12, hidden=128, positions=128, attention="eager").to(device)
            strategy.apply(model, discover_blocks(model))
            loss_of(model, ids).backward()  # warm-up: allocator, kernels, the side stream
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            loss = loss_of(model, ids)
            after_forward = torch.cuda.memory_allocated(device) - before
            loss.backward()
            torch.cuda.synchronize()
            results[strategy.name] = (loss.detach(), [p.grad for p in model.parameters()], after_forward)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    (ref_loss, ref_grads, none_bytes), (loss, grads, offload_bytes) = results["none"], results["offload"]
    assert torch.equal(ref_loss, loss)
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads, strict=True))
    assert offload_bytes < 0.2 * none_bytes, (offload_bytes, none_bytes)


class _NormBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


@pytest.mark.parametrize("mode", ["full", "selective", "fraction"])
def test_a_recompute_counts_the_batch_in_running_statistics_once(mode: str) -> None:
    """BatchNorm in a recomputed block: the recompute normalises with the batch's statistics as the forward
    did, and the running statistics move once per forward, as without checkpointing."""

    def trained(strategy: Checkpointing) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(*(_NormBlock() for _ in range(4)))
        strategy.apply(model, list(model))
        x = torch.randn(16, 8)
        for _ in range(2):
            model(x).square().sum().backward()
        return model.state_dict(), [p.grad.clone() for p in model.parameters()]

    plain_state, plain_grads = trained(CHECKPOINTING.create("none"))
    state, grads = trained(CHECKPOINTING.create(mode))
    assert plain_state["0.norm.num_batches_tracked"] == 2
    assert all(torch.equal(state[k], v) for k, v in plain_state.items()), [
        k for k, v in plain_state.items() if not torch.equal(state[k], v)
    ]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
