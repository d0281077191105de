"""Base-weight quantisation (QLoRA): the byte estimate against the tensors bitsandbytes creates, the layer
swap, forward/backward through a frozen quantised base on the CPU (and on CUDA where there is one), and
the registry's names."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from memtrain.errors import Unsupported
from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo
from memtrain.strategies.blocks import model_shape
from memtrain.strategies.quantization import FP4, QUANTIZATION, FourBit, Int8, Quantization
from memtrain.strategies.registry import DeviceFacts

bnb = pytest.importorskip("bitsandbytes")

FOUR_BIT = [
    QUANTIZATION.create(name, {"double_quant": double_quant, "quantization_block_size": block_size})
    for name in ("nf4", "fp4")
    for double_quant in (True, False)
    for block_size in (64, 256)
]
ALL_FORMATS = [*FOUR_BIT, QUANTIZATION.create("int8")]
# (out_features, in_features): numel divisible by the block size, not divisible (561 and 35 are odd, so
# the last packed byte is half padding), less than one block, and more than 256 blocks (several
# second-level absmax values under double quantisation, the last one partial).
SHAPES = [(64, 64), (33, 17), (5, 7), (300, 200), (1000, 70)]


# ------------------------------------------------------------------------------------------- helpers


class Block(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up: Any = nn.Linear(hidden, inner, bias=True)
        self.down: Any = nn.Linear(inner, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class Tiny(nn.Module):
    """Embedding, two blocks of linears (with and without bias), an output head, and one trainable extra
    parameter before the blocks, so its gradient flows back through every quantised layer."""

    def __init__(self, vocab: int = 32, hidden: int = 48, inner: int = 80) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks: list[Block] = nn.ModuleList(Block(hidden, inner) for _ in range(2))  # type: ignore[assignment]
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h)


def is_head(name: str) -> bool:
    return name == "lm_head"


def frozen_base(model: Tiny) -> Tiny:
    """Everything frozen but the extra parameter (what LoRA leaves trainable, in miniature)."""
    for name, param in model.named_parameters():
        param.requires_grad_(name == "scale")
    return model


def storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers and every tensor of the
    bitsandbytes quantisation states they carry (nested states and int8 row scales included)."""
    seen: set[int] = set()
    total = 0

    def add(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, (bnb.functional.QuantState, bnb.MatmulLtState)):
            for value in vars(obj).values():
                add(value)

    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            add(tensor)
            add(getattr(tensor, "quant_state", None))
            add(getattr(tensor, "CB", None))
            add(getattr(tensor, "SCB", None))
        add(getattr(module, "quant_state", None))
        add(getattr(module, "state", None))
    return total


def dequantised(layer: Any) -> torch.Tensor:
    """The weight a quantised layer multiplies by, in fp32."""
    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    cb = layer.weight.CB if layer.weight.CB is not None else layer.state.CB
    scb = layer.weight.SCB if layer.weight.SCB is not None else layer.state.SCB
    return cb.float() * scb.float().unsqueeze(1) / 127.0


def reference_of(model: Tiny) -> Tiny:
    """A plain fp32 copy of a quantised `Tiny` with the weights its quantised layers really use."""
    reference = frozen_base(Tiny())
    with torch.no_grad():
        reference.embed.weight.copy_(model.embed.weight)
        reference.lm_head.weight.copy_(model.lm_head.weight)
        for ours, theirs in zip(reference.blocks, model.blocks, strict=True):
            ours.up.weight.copy_(dequantised(theirs.up))
            ours.up.bias.copy_(theirs.up.bias.float())
            ours.down.weight.copy_(dequantised(theirs.down))
    return reference


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


# ------------------------------------------------------------------------- (1) bytes, to the byte


@pytest.mark.parametrize("strategy", ALL_FORMATS, ids=lambda s: s.describe())
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_weight_bytes_equal_the_tensors_bitsandbytes_creates(
    strategy: Quantization, out_features: int, in_features: int
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False))
    assert strategy.apply(model, lambda name: False, torch.float32) == ["0"]
    measured = storage_bytes(model)
    numel = out_features * in_features
    assert strategy.weight_bytes([numel], [out_features]) == measured
    assert measured < 4 * numel or numel < 100  # small tensors pay more in constants than they save


def test_the_constants_are_what_the_formula_says() -> None:
    """One hand-worked case each, so a change in a constant shows up as a number, not only a mismatch."""
    numel = 1000 * 70  # 70000 elements
    nf4 = QUANTIZATION.create("nf4", {"double_quant": False})
    assert nf4.weight_bytes([numel]) == 35000 + 1094 * 4 + 64  # packed, fp32 absmax per 64, the code
    nf4_dq = QUANTIZATION.create("nf4")
    assert nf4_dq.weight_bytes([numel]) == 35000 + 1094 + 4 + 5 * 4 + 1024 + 64
    assert QUANTIZATION.create("int8").weight_bytes([numel], [1000]) == 70000 + 1000 * 4
    assert QUANTIZATION.create("none").weight_bytes([numel], param_bytes=2) == 2 * numel


@pytest.mark.parametrize("strategy", ALL_FORMATS, ids=lambda s: s.describe())
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_estimate_equals_the_quantised_model(strategy: Quantization, compute_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = frozen_base(Tiny())
    shape = model_shape(model, list(model.blocks))
    rows = {f"{name}.weight": m.out_features for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    before = storage_bytes(model)
    assert before == 4 * shape.numel
    replaced = strategy.apply(model, is_head, compute_dtype)

    def quantised(p: ParamInfo) -> bool:
        return p.name.removesuffix(".weight") in replaced and p.name.endswith(".weight")

    footprint = Footprint(weights=before, activations=123)
    estimate = strategy.estimate(
        shape,
        footprint,
        quantised,
        param_bytes=4,
        compute_bytes=compute_dtype.itemsize,
        rows=lambda p: rows[p.name],
    )
    assert estimate.weights == storage_bytes(model)
    assert estimate.weights < before
    assert estimate.with_(weights=before) == footprint  # nothing but the weights changes


def test_estimate_refuses_trainable_quantised_weights_and_none_changes_nothing() -> None:
    shape = ModelShape((ParamInfo("a.weight", 4096, 0, trainable=True),), 1)
    footprint = Footprint(weights=4 * 4096)
    with pytest.raises(ValueError, match="a.weight"):
        QUANTIZATION.create("nf4").estimate(shape, footprint, lambda p: True)
    assert QUANTIZATION.create("none").estimate(shape, footprint, lambda p: True) == footprint
    with pytest.raises(ValueError, match="rows"):
        QUANTIZATION.create("int8").weight_bytes([4096])


# --------------------------------------------------------------------------------- (2) the swap


@pytest.mark.parametrize("strategy", ALL_FORMATS[:1] + ALL_FORMATS[2:3] + ALL_FORMATS[-1:], ids=str)
def test_apply_replaces_the_linears_but_the_skipped_ones_and_freezes_them(strategy: Quantization) -> None:
    torch.manual_seed(0)
    model = Tiny()
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    bias = model.blocks[0].up.bias.detach().clone()
    embed, head = model.embed, model.lm_head
    replaced = strategy.apply(model, is_head, torch.bfloat16)

    assert replaced == ["blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"]
    layer_type = bnb.nn.Linear8bitLt if isinstance(strategy, Int8) else bnb.nn.Linear4bit
    for name in replaced:
        layer = model.get_submodule(name)
        assert isinstance(layer, layer_type)
        assert all(not p.requires_grad for p in layer.parameters())
        assert layer.weight.dtype in (torch.uint8, torch.int8)
        # quantised from the layer's own weights, not from a fresh initialisation
        error = (dequantised(layer) - originals[name]).norm() / originals[name].norm()
        assert error < (0.02 if isinstance(strategy, Int8) else 0.15)
    assert model.blocks[0].up.bias.dtype == torch.bfloat16
    torch.testing.assert_close(model.blocks[0].up.bias.float(), bias, rtol=1e-2, atol=1e-3)
    assert model.lm_head is head and type(head) is nn.Linear and head.weight.requires_grad
    assert model.embed is embed and model.scale.requires_grad
    assert QUANTIZATION.create("none").apply(model, is_head, torch.float32) == []


def test_apply_refuses_meta_weights_and_tied_weights() -> None:
    with torch.device("meta"):
        meta = Tiny()
    with pytest.raises(Unsupported, match="model.quantization: .*meta device"):
        QUANTIZATION.create("nf4").apply(meta, is_head, torch.float32)

    tied = Tiny(vocab=48, hidden=48)
    tied.blocks[1].up.weight = tied.lm_head.weight  # shared, as tied embeddings are
    with pytest.raises(Unsupported, match="lm_head.weight.*tied"):
        QUANTIZATION.create("nf4").apply(tied, is_head, torch.float32)
    assert type(tied.blocks[0].up) is nn.Linear  # checked before anything was replaced


# -------------------------------------------------------------------- (3) forward and backward


@pytest.mark.parametrize("strategy", ALL_FORMATS, ids=lambda s: s.describe())
def test_cpu_forward_backward_through_the_frozen_quantised_base(strategy: Quantization) -> None:
    strategy.check(DeviceFacts("cpu"))  # bitsandbytes runs these on the CPU: allowed
    torch.manual_seed(0)
    model = frozen_base(Tiny())
    strategy.apply(model, is_head, torch.float32)
    reference = reference_of(model)
    ids = torch.randint(0, 32, (3, 9), generator=torch.Generator().manual_seed(1))

    loss = loss_of(model, ids)
    loss.backward()
    expected = loss_of(reference, ids)
    expected.backward()

    grad = model.scale.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, reference.scale.grad, rtol=1e-3, atol=1e-5)
    assert all(p.grad is None for n, p in model.named_parameters() if n != "scale")


@pytest.mark.parametrize("strategy", [FOUR_BIT[0], QUANTIZATION.create("int8")], ids=str)
def test_training_still_has_gradients_after_an_eval_forward(strategy: Quantization) -> None:
    """bitsandbytes repacks a Linear4bit for a CPU inference kernel at its first eval forward without
    gradients (on AVX-512-BF16 CPUs), after which its backward returns no input gradient; `apply`
    turns that off. Output sizes here (80, 48) are not multiples of 32, which the repacking asserts."""
    torch.manual_seed(0)
    model = frozen_base(Tiny())
    strategy.apply(model, is_head, torch.bfloat16)
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(2))
    bytes_before = storage_bytes(model)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(loss_of(model, ids))
    model.train()
    loss_of(model, ids).backward()
    assert model.scale.grad is not None and torch.isfinite(model.scale.grad).all()
    assert model.scale.grad.abs().sum() > 0
    assert storage_bytes(model) == bytes_before  # no repacked copy, no extra state


def test_check_names_the_key_when_the_format_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for strategy in ALL_FORMATS:
        strategy.check(DeviceFacts("cuda"))
        with pytest.raises(Unsupported, match=r"model\.quantization: .* not on mps; use model\.quantization"):
            strategy.check(DeviceFacts("mps"))
    QUANTIZATION.create("none").check(DeviceFacts("mps"))
    with pytest.raises(Unsupported, match="model.quantization_block_size: 48"):
        QUANTIZATION.create("nf4", {"quantization_block_size": 48}).check(DeviceFacts("cuda"))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what a missing package looks like
    with pytest.raises(Unsupported, match=r"model\.quantization: fp4 needs bitsandbytes.*memtrain\[bnb\]"):
        QUANTIZATION.create("fp4").check(DeviceFacts("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ALL_FORMATS, ids=lambda s: s.describe())
def test_cuda_forward_backward_and_bytes(strategy: Quantization) -> None:
    strategy.check(DeviceFacts.of(torch.device("cuda")))
    torch.manual_seed(0)
    model = frozen_base(Tiny()).cuda()
    shape = model_shape(model, list(model.blocks))
    rows = {f"{name}.weight": m.out_features for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    before = storage_bytes(model)
    replaced = strategy.apply(model, is_head, torch.bfloat16)
    estimate = strategy.estimate(
        shape,
        Footprint(weights=before),
        lambda p: p.name.endswith(".weight") and p.name.removesuffix(".weight") in replaced,
        compute_bytes=2,
        rows=lambda p: rows[p.name],
    )
    assert estimate.weights == storage_bytes(model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    ids = torch.randint(0, 32, (3, 9), device="cuda")
    loss = loss_of(model, ids)
    loss.backward()
    assert torch.isfinite(loss)
    assert model.scale.grad is not None and torch.isfinite(model.scale.grad).all()
    assert model.scale.grad.abs().sum() > 0


# ------------------------------------------------------------------------------- (4) the registry


def test_registry_names_options_and_round_trip() -> None:
    assert QUANTIZATION.names() == ("none", "nf4", "fp4", "int8")
    assert QUANTIZATION.kind == "quantization" and Quantization.name == "none"
    nf4 = QUANTIZATION.create("nf4", {"double_quant": False, "quantization_block_size": 128})
    assert isinstance(nf4, FourBit) and (nf4.double_quant, nf4.block_size) == (False, 128)
    assert QUANTIZATION.create("fp4") == FP4(double_quant=True, block_size=64)
    for strategy in ALL_FORMATS:
        assert QUANTIZATION.from_dict(strategy.to_dict()) == strategy
    assert nf4.describe() == "nf4(False, 128)"
