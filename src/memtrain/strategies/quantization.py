"""Base-weight quantisation for QLoRA: the frozen base model's linear weights stored in 4 or 8 bits.

Why: in LoRA fine-tuning the base weights are frozen, so they have no gradients and no optimizer states,
and the weights themselves become the largest model state (2-4 bytes per parameter). Storing the frozen
linears in 4 bits (QLoRA) cuts them to about 0.5 bytes per parameter; the adapters keep training in
full precision on top. Names (`model.quantization`):

- `none`: the weights stay as they are.
- `nf4`, `fp4`: bitsandbytes `Linear4bit` (4-bit NormalFloat or FP4). Options: `double_quant` (QLoRA's
  double quantisation: the fp32 absmax per block is itself quantised to 8 bits) and `block_size`
  (elements per absmax, `model.quantization_block_size`).
- `int8`: bitsandbytes LLM.int8 `Linear8bitLt` (row-wise int8 weights). Option: `threshold`, the outlier
  threshold of the mixed-precision decomposition (6.0, as in the paper and transformers; 0 turns it off).

`apply` replaces the model's `nn.Linear` layers (not those `skip(name)` names, e.g. the output head) with
the quantised layers, quantised from the layer's own weights, and freezes them (weight and bias: a
quantised layer never trains). It must run after the weights are loaded (quantisation reads their
values) and before the adapters are added (peft wraps the quantised layers). 4-bit weights are
quantised from a copy in `compute_dtype`, the dtype the layers compute in, so that the backward pass
dequantises into it (int8 quantises from fp16, as bitsandbytes does). The bias is stored in
`compute_dtype` too: bitsandbytes' `Linear4bit` would cast it at its first forward, changing the bytes
after the plan was made.

Sharded (FSDP2's zero2/zero3: `shards_under`): the same bitsandbytes layers, whose `Params4bit` stores the
packed 4-bit values as a uint8 tensor of shape ((n + 1) // 2, 1); FSDP2 shards that tensor on dim 0 like
any frozen parameter, all-gathers it as stored (an integer tensor: no mixed-precision cast) before the
block runs, and `Linear4bit` dequantises the gathered bytes with the quantisation state it keeps on the
module (bitsandbytes' `fix_4bit_weight_quant_state_from_module`), whole on every rank. Each rank quantises
the whole base (deterministic, so the ranks agree) and keeps its shard. Why bitsandbytes and not torchao's
`NF4Tensor` (which implements FSDP2's all-gather hooks and shards its scales too): both trained under
FSDP2 on 2 gloo ranks here, but bitsandbytes' gathered layer computes bit for bit what the replicated layer
computes (max difference 0.0 in fp32), so `nf4` means the same weights with any sharding, the replicated
behaviour, its byte arithmetic and checkpoints are unchanged, and a zero3 run trains like one process;
torchao's NF4 quantises differently (its own double quantisation), casts to a float dtype by dequantising
(which the precision's frozen-weight cast would do), and needs each weight's size to be a multiple of
64 x 256 elements and its inner tensors to split evenly over the ranks. What bitsandbytes costs: the constants (absmax, nested absmax, code tables: ~1/64 byte
per element with double quantisation, 3% of the packed bytes) are not sharded, as in Hugging Face's
FSDP-QLoRA (`sharded_layout`). zero1 (ZeroRedundancyOptimizer over DDP, untested with these layers),
DeepSpeed (its flat buffers reinterpret the packed bytes; zero.Init fails on this stack) and int8 under
FSDP2 (its row scales live on the weight tensor FSDP2 replaces) are refused naming the key
(`check_sharding`). A meta-device (pretrained) base under FSDP2 is loaded whole on the host and quantised
onto the device layer by layer (`apply(device=...)`): the transient is host memory, a full base per rank.

`weight_bytes` / `estimate` are the planner's arithmetic: the bytes of the quantised weights *with* their
quantisation constants, checked to the byte by tests/strategies/test_quantization.py against the tensors
bitsandbytes creates. The constants below were read from bitsandbytes 0.50 (see each comment).

On the CPU (measured on an AVX-512 Xeon with bitsandbytes 0.50.2 and torch 2.13): nf4, fp4 (with and
without double quantisation) and int8 quantise, run forward and backward to a trainable input in fp32,
bf16 and fp16. Two CPU-only caveats of bitsandbytes, handled here: `Linear4bit` repacks its weight for
an AVX-512-BF16 inference kernel at the first eval-mode forward without gradients, after which the
backward silently returns no input gradient (the kernel has no autograd) and which asserts for output
sizes not divisible by 32, so `apply` turns that repacking off; and in training mode on the CPU
`Linear8bitLt` dequantises its int8 weight and multiplies in the input's dtype (bitsandbytes'
`MatMul8bitFp`), so int8 saves memory there but computes like a dense layer.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn

from memtrain.errors import Unsupported
from memtrain.memory.footprint import Footprint, ModelShape, ParamInfo
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy, option
from memtrain.strategies.sharding import Sharding
from memtrain.strategies.sharding.state_bytes import QuantisedWeight

# 4-bit (bitsandbytes/functional.py `quantize_4bit` and `QuantState`, backends/*/ops.py `quantize_4bit`):
BNB_4BIT_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the block sizes quantize_4bit accepts
BNB_4BIT_CODE_BYTES = 16 * 4  # `code = get_4bit_type(...)`: the 16-entry fp32 table, a new tensor per state
BNB_ABSMAX_BYTES = 4  # one fp32 absmax per block of `blocksize` elements (the op returns float32)
# double quantisation (`compress_statistics=True`): `offset = absmax.mean()`, then
# `quantize_blockwise(absmax - offset, blocksize=256)` -> uint8 absmax + a nested QuantState (`state2`)
BNB_NESTED_BLOCK_SIZE = 256  # blocks of absmax per second-level fp32 absmax
BNB_NESTED_ABSMAX_BYTES = 1  # each first-level absmax as uint8
BNB_NESTED_CODE_BYTES = 256 * 4  # `state2.code`: the 256-entry fp32 dynamic map, copied per state
BNB_OFFSET_BYTES = 4  # `offset`: a 0-dim fp32 tensor
# int8 (bitsandbytes/nn/modules.py `Int8Params._quantize` -> functional.py `int8_vectorwise_quant`):
BNB_INT8_SCALE_BYTES = 4  # `SCB`: one fp32 absmax per row (output feature) of the int8 weight `CB`

# Why each layout that shards but cannot hold a quantised base refuses it (`Quantization.check_sharding`).
SHARDING_REFUSALS = {
    "zero1": "ZeroRedundancyOptimizer over DDP is untested with bitsandbytes layers; use strategies.sharding "
    "zero3 (sharding_backend fsdp2), ddp or none",
    "fsdp2": "FSDP2 gathers a weight as a plain tensor, without the row scales int8 keeps on it "
    "(Int8Params.SCB); use nf4 or fp4, or strategies.sharding ddp or none",
    "deepspeed": "DeepSpeed partitions parameters by flattening them into its dtype's buffers, which would "
    "reinterpret the packed 4-bit bytes, and its zero.Init fails on this stack; use "
    "strategies.sharding_backend fsdp2",
}
SUPPORTED_DEVICES = ("cuda", "cpu")  # bitsandbytes' CUDA kernels; CPU checked by the tests here
BNB_MODULE = "bitsandbytes"


@dataclass(frozen=True)
class Quantization(Strategy):
    """`none`: the base weights stay as they are. Subclasses store the frozen linears quantised."""

    kind: ClassVar[str] = "quantization"
    name: ClassVar[str] = "none"
    bits: ClassVar[int] = 16  # bits per stored base weight (4 or 8 for the bitsandbytes formats)

    def apply(
        self,
        model: nn.Module,
        skip: Callable[[str], bool],
        compute_dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> list[str]:
        """Replace `model`'s linear layers in place, each quantised onto `device` (default: where its weight
        is); return the names of the replaced modules."""
        return []

    def stand_in(self, model: nn.Module, skip: Callable[[str], bool], compute_dtype: torch.dtype) -> None:
        """What the planner's fake-tensor trace runs in place of `apply` (nothing, without quantisation)."""

    def check_sharding(self, sharding: Sharding) -> None:
        """`Unsupported` when the base cannot be stored as `sharding` lays weights out: the replicated layouts
        (none, ddp) keep it whole on every rank, FSDP2's zero2/zero3 shard its packed storage (module
        docstring); zero1 and DeepSpeed cannot hold it. The one rule for the planner's grid, a pinned plan
        and `memtrain validate`."""
        if self.name == "none" or sharding.replicated or self.shards_under(sharding):
            return
        layout = (
            "deepspeed" if sharding.backend == "deepspeed" else "zero1" if sharding.name == "zero1" else ""
        )
        raise Unsupported(
            f"model.quantization: {self.name} with strategies.sharding {sharding.name} (sharding_backend "
            f"{sharding.backend}): {SHARDING_REFUSALS.get(layout, SHARDING_REFUSALS['fsdp2'])}"
        )

    def shards_under(self, sharding: Sharding) -> bool:
        """Whether `sharding` shards this base's stored weights across ranks (only 4-bit, under FSDP2)."""
        return False

    def packed_stand_in(
        self, model: nn.Module, skip: Callable[[str], bool], compute_dtype: torch.dtype
    ) -> None:
        """What the rank trace runs in place of `apply` on its meta model (nothing, without quantisation)."""

    def sharded_layout(self, numel: int) -> QuantisedWeight:
        """How a sharding backend lays out a weight of `numel` elements stored in this format (what it
        shards and gathers, what stays whole): for the formats `shards_under` some sharding."""
        raise NotImplementedError(f"model.quantization: {self.name} is not sharded")

    def weight_bytes(
        self,
        numel_per_tensor: Sequence[int],
        rows_per_tensor: Sequence[int] | None = None,
        param_bytes: int = 4,
    ) -> int:
        """Bytes of these weight tensors stored in this format, quantisation constants included.

        `rows_per_tensor` (output features of each weight) is needed only by row-wise formats (int8);
        `param_bytes` (the element size of unquantised weights) only by `none`.
        """
        return param_bytes * sum(numel_per_tensor)

    def estimate(
        self,
        shape: ModelShape,
        footprint: Footprint,
        quantised: Callable[[ParamInfo], bool],
        *,
        param_bytes: int = 4,
        compute_bytes: int | None = None,
        rows: Callable[[ParamInfo], int] | None = None,
    ) -> Footprint:
        """`footprint` with the weights of the parameters `quantised` selects stored in this format.

        `footprint.weights` counts every parameter at `param_bytes` each; the selected ones are replaced
        by `weight_bytes` of them. The bias of a quantised layer (the parameter `<module>.bias` next to a
        selected `<module>.weight`) is stored in the compute dtype, `compute_bytes` each (default
        `param_bytes`); every other parameter keeps its bytes. A quantised weight never trains, so one
        marked trainable in `shape` is an error of the caller (its gradient would be counted).
        `rows(p)` gives a weight's output features (int8's row-wise scales).
        """
        return footprint


QUANTIZATION: Registry[Quantization] = Registry(
    "quantization",
    Quantization,
    RecipeKey(
        "model",
        "quantization",
        "none",
        "Base-weight quantisation for QLoRA: none, nf4, fp4 or int8 (bitsandbytes).",
        changes_trajectory=True,
        planner_choice=False,
    ),
)
QUANTIZATION.register(Quantization)


@dataclass(frozen=True)
class BitsAndBytes(Quantization):
    """What the bitsandbytes formats share: the device check, the layer swap and the estimate."""

    def check(self, facts: DeviceFacts) -> None:
        if facts.mesh is not None and facts.mesh.tp > 1:
            raise Unsupported(
                f"model.quantization: {self.name} with strategies.mesh.tp={facts.mesh.tp}: tensor parallelism "
                "splits nn.Linear weights by rows and columns, not bitsandbytes' packed ones; set "
                "strategies.mesh.tp: 1 (FSDP2's zero3 shards the quantised base)"
            )
        if facts.device_type not in SUPPORTED_DEVICES:
            raise Unsupported(
                f"model.quantization: {self.name} runs on {' or '.join(SUPPORTED_DEVICES)} (bitsandbytes "
                f"kernels), not on {facts.device_type}; use model.quantization: none"
            )
        _bitsandbytes(self.name)

    def apply(
        self,
        model: nn.Module,
        skip: Callable[[str], bool],
        compute_dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> list[str]:
        bnb = _bitsandbytes(self.name)
        targets = [(n, m) for n, m in model.named_modules() if n and type(m) is nn.Linear and not skip(n)]
        owners: dict[int, list[str]] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for param_name, param in module.named_parameters(prefix=module_name, recurse=False):
                owners.setdefault(id(param), []).append(param_name)
        for module_name, linear in targets:
            if linear.weight.is_meta:
                raise Unsupported(
                    f"model.quantization: {module_name}.weight is on the meta device; quantisation reads "
                    "the weights' values, so it runs after they are loaded"
                )
            tied = owners[id(linear.weight)]
            if len(tied) > 1:
                raise Unsupported(
                    f"model.quantization: {' and '.join(tied)} are one tied tensor; quantising one would "
                    f"untie them, so leave {module_name} unquantised (skip it)"
                )
        for module_name, linear in targets:
            layer = self._layer(bnb, linear, compute_dtype, device or linear.weight.device)
            if linear.bias is not None:
                bias = linear.bias.detach().to(device=device or linear.bias.device, dtype=compute_dtype)
                layer.bias = nn.Parameter(bias, requires_grad=False)
            layer.train(linear.training)
            parent, _, child = module_name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
        return [n for n, _ in targets]

    def _layer(
        self, bnb: ModuleType, linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """The quantised layer holding `linear`'s weight on `device` (its bias is set by `apply`)."""
        raise NotImplementedError

    def stand_in(self, model: nn.Module, skip: Callable[[str], bool], compute_dtype: torch.dtype) -> None:
        """What the planner traces instead (bitsandbytes' layers cannot hold fake tensors): each target
        linear, frozen, computing as a quantised layer does: its input cast to `compute_dtype`, the weight
        dequantised into a transient copy for the forward and again for the backward (nothing of it saved),
        the output cast back to the input's dtype. The weights' bytes come from `estimate`."""
        for name, module in model.named_modules():
            if name and type(module) is nn.Linear and not skip(name):
                module.__class__ = DequantisedLinear
                module.compute_dtype = compute_dtype  # type: ignore[assignment]
                module.requires_grad_(False)

    def estimate(
        self,
        shape: ModelShape,
        footprint: Footprint,
        quantised: Callable[[ParamInfo], bool],
        *,
        param_bytes: int = 4,
        compute_bytes: int | None = None,
        rows: Callable[[ParamInfo], int] | None = None,
    ) -> Footprint:
        chosen = [p for p in shape.params if quantised(p)]
        trainable = [p.name for p in chosen if p.trainable]
        if trainable:
            raise ValueError(f"quantised weights cannot train, but these are marked trainable: {trainable}")
        chosen_names = {p.name for p in chosen}
        biases = [
            p
            for p in shape.params
            if p.name.endswith(".bias") and p.name[: -len("bias")] + "weight" in chosen_names
        ]
        before = param_bytes * (sum(p.numel for p in chosen) + sum(p.numel for p in biases))
        after = self.weight_bytes(
            [p.numel for p in chosen], None if rows is None else [rows(p) for p in chosen]
        ) + (param_bytes if compute_bytes is None else compute_bytes) * sum(p.numel for p in biases)
        return footprint.with_(weights=footprint.weights - before + after)


@dataclass(frozen=True)
class FourBit(BitsAndBytes):
    bits: ClassVar[int] = 4
    """bitsandbytes `Linear4bit`: blockwise 4-bit weights, one absmax per `block_size` elements."""

    quant_type: ClassVar[str] = ""
    double_quant: bool = option(
        True,
        recipe_key="double_quant",
        doc="nf4/fp4: quantise the per-block scales too (QLoRA).",
        changes_trajectory=True,
    )
    block_size: int = option(64, doc="nf4/fp4: elements per scale.", changes_trajectory=True, gt=0)

    def shards_under(self, sharding: Sharding) -> bool:
        return sharding.name in ("zero2", "zero3") and sharding.backend == "fsdp2"

    def check(self, facts: DeviceFacts) -> None:
        if self.block_size not in BNB_4BIT_BLOCK_SIZES:
            raise Unsupported(
                f"model.quantization_block_size: {self.block_size} is not one of "
                f"{', '.join(map(str, BNB_4BIT_BLOCK_SIZES))} (bitsandbytes 4-bit block sizes); 64 is QLoRA's"
            )
        super().check(facts)

    def weight_bytes(
        self,
        numel_per_tensor: Sequence[int],
        rows_per_tensor: Sequence[int] | None = None,
        param_bytes: int = 4,
    ) -> int:
        return sum(self._tensor_bytes(n) for n in numel_per_tensor)

    def packed_stand_in(
        self, model: nn.Module, skip: Callable[[str], bool], compute_dtype: torch.dtype
    ) -> None:
        """The rank trace's stand-in (its model is on the meta device, then fake: no values to quantise):
        each target linear as a `PackedLinear` holding the layout `sharded_layout` gives, which FSDP2 shards
        and gathers as it does bitsandbytes' packed weight."""
        for name, module in list(model.named_modules()):
            if name and type(module) is nn.Linear and not skip(name):
                layout = self.sharded_layout(module.in_features * module.out_features)
                module.__class__ = PackedLinear
                device = module.weight.device
                packed = torch.empty((layout.rows, layout.row_bytes), dtype=torch.uint8, device=device)
                module.weight = nn.Parameter(packed, requires_grad=False)
                module.register_buffer(
                    "constants", torch.empty(layout.whole, dtype=torch.uint8, device=device)
                )
                module.compute_dtype = compute_dtype  # type: ignore[assignment]
                if module.bias is not None:
                    module.bias.requires_grad_(False)

    def sharded_layout(self, numel: int) -> QuantisedWeight:
        """`Params4bit`'s packed uint8 storage, ((numel + 1) // 2, 1), sharded on dim 0 (its bytes as rows),
        and its quantisation state (absmax, nested absmax, code tables) whole on every rank."""
        packed = (numel + 1) // 2
        return QuantisedWeight(rows=packed, row_bytes=1, whole=self._tensor_bytes(numel) - packed)

    def _tensor_bytes(self, numel: int) -> int:
        packed = (numel + 1) // 2  # two 4-bit values per uint8, the last one padded
        blocks = math.ceil(numel / self.block_size)
        if not self.double_quant:
            return packed + blocks * BNB_ABSMAX_BYTES + BNB_4BIT_CODE_BYTES
        nested = math.ceil(blocks / BNB_NESTED_BLOCK_SIZE) * BNB_ABSMAX_BYTES + BNB_NESTED_CODE_BYTES
        absmax = blocks * BNB_NESTED_ABSMAX_BYTES + BNB_OFFSET_BYTES + nested
        return packed + absmax + BNB_4BIT_CODE_BYTES

    def _layer(
        self, bnb: ModuleType, linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        layer: Any = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            device="meta",  # no throwaway random weight; the real one is set below
        )
        # Off: the CPU inference repacking that breaks the backward afterwards (module docstring).
        layer.support_avx512bf16_for_cpu = False
        weight = bnb.nn.Params4bit(
            linear.weight.detach().to(compute_dtype),
            requires_grad=False,
            blocksize=self.block_size,
            compress_statistics=self.double_quant,
            quant_type=self.quant_type,
            module=layer,
        )
        layer.weight = weight.to(device)  # quantises (Params4bit.to -> _quantize)
        return layer


@QUANTIZATION.register
@dataclass(frozen=True)
class NF4(FourBit):
    """4-bit NormalFloat (QLoRA's format: quantiles of a normal distribution)."""

    name: ClassVar[str] = "nf4"
    quant_type: ClassVar[str] = "nf4"


@QUANTIZATION.register
@dataclass(frozen=True)
class FP4(FourBit):
    """4-bit floating point (1 sign, 2 exponent, 1 mantissa bit)."""

    name: ClassVar[str] = "fp4"
    quant_type: ClassVar[str] = "fp4"


@QUANTIZATION.register
@dataclass(frozen=True)
class Int8(BitsAndBytes):
    bits: ClassVar[int] = 8
    """bitsandbytes LLM.int8 `Linear8bitLt`: int8 weights with one fp32 scale per output row.

    `Linear8bitLt` computes in its input's dtype, so a forward pre-hook casts the input to
    `compute_dtype` (the output stays in it, as under autocast), which also keeps the bias's dtype fixed.
    """

    name: ClassVar[str] = "int8"
    threshold: float = option(
        6.0,
        doc="int8: the outlier threshold of LLM.int8()'s mixed-precision decomposition (0 turns it off).",
        changes_trajectory=True,
        ge=0.0,
    )

    def weight_bytes(
        self,
        numel_per_tensor: Sequence[int],
        rows_per_tensor: Sequence[int] | None = None,
        param_bytes: int = 4,
    ) -> int:
        if rows_per_tensor is None or len(rows_per_tensor) != len(numel_per_tensor):
            raise ValueError("int8 has one scale per row: give the rows (output features) of every weight")
        return sum(numel_per_tensor) + BNB_INT8_SCALE_BYTES * sum(rows_per_tensor)

    def _layer(
        self, bnb: ModuleType, linear: nn.Linear, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        layer: Any = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            has_fp16_weights=False,
            threshold=self.threshold,
            device="meta",
        )
        # What Int8Params._quantize does, on whatever device the weight is (Int8Params.to quantises only
        # when the weight comes from the CPU).
        source = linear.weight.detach().to(device=device, dtype=torch.float16).contiguous()
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(source)
        layer.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
        layer.compute_dtype = compute_dtype
        layer.register_forward_pre_hook(_input_to_compute_dtype)
        return layer


def _input_to_compute_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    dtype: torch.dtype = module.__dict__["compute_dtype"]
    return (args[0].to(dtype), *args[1:])


def _bitsandbytes(name: str) -> ModuleType:
    try:
        return importlib.import_module(BNB_MODULE)
    except ImportError as exc:
        raise Unsupported(
            f"model.quantization: {name} needs bitsandbytes, which cannot be imported ({exc}); "
            "pip install 'memtrain[bnb]', or use model.quantization: none"
        ) from None


class DequantisedLinear(nn.Linear):
    """The planner's stand-in of a quantised linear (see `BitsAndBytes.stand_in`)."""

    compute_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DequantisedMatmul.apply(x.to(self.compute_dtype), self.weight, self.compute_dtype)
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(x.dtype)  # type: ignore[no-any-return]


class _DequantisedMatmul(torch.autograd.Function):
    """x @ dequant(W).T, keeping only the (stored) weight for backward, as bitsandbytes' matmuls do."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(weight)
        ctx.dtype = dtype
        dequantised = weight.to(dtype, copy=True)
        return x @ dequantised.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(ctx.dtype, copy=True), None, None


class PackedLinear(nn.Linear):
    """The rank trace's stand-in of a 4-bit layer (`FourBit.packed_stand_in`): `weight` is the packed uint8
    storage, `constants` a uint8 buffer of the quantisation state's bytes (a buffer: FSDP2 keeps it whole,
    as bitsandbytes keeps its state on the module); the forward dequantises into a transient (out, in) copy
    in the compute dtype for the forward and again for the backward, as `DequantisedLinear` does."""

    compute_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _UnpackedMatmul.apply(
            x.to(self.compute_dtype), self.weight, self.out_features, self.compute_dtype
        )
        if self.bias is not None:
            out = out + self.bias.to(self.compute_dtype)
        return out.to(x.dtype)  # type: ignore[no-any-return]


class _UnpackedMatmul(torch.autograd.Function):
    """x @ W.T with W (out x in) unpacked from the packed bytes (placeholder values: the rank trace's
    tensors are fake), keeping only the packed weight for backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, packed: torch.Tensor, rows: int, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(packed)
        ctx.shape = (rows, x.shape[-1])
        ctx.dtype = dtype
        return x @ packed.new_empty(ctx.shape, dtype=dtype).t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (packed,) = ctx.saved_tensors
        return grad @ packed.new_empty(ctx.shape, dtype=ctx.dtype), None, None, None
