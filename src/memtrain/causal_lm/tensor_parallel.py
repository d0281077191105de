"""The built-in causal-LM trainer's tensor-parallel plan: transformers' own plan for the blocks, memtrain's for
the sequence, the embedding and the head.

Why this split: transformers ships, per family, which of a block's linears are split by columns and which by
rows (`config.base_model_tp_plan`, e.g. `layers.*.self_attn.q_proj: colwise`); that is the model's knowledge
and is read, not repeated. What a training run adds is the same for every such family:

- Sequence parallel (Korthikanti et al. 2022): between the row-wise linears and the next column-wise ones the
  activations are sharded along the sequence, so the norms (and the residual stream) hold 1/t of the tokens.
  The row-wise linears reduce-scatter instead of all-reducing; the attention and MLP inputs are all-gathered
  once each (`_GatherSequence` on those modules, one gather shared by their q/k/v or gate/up linears).
  The embedding's output stays whole (transformers derives positions and the causal mask from it) and the
  first block splits the sequence (`_ScatterSequence`). Norm weights stay replicated; their gradients are
  partial sums that FSDP (or the optimizer's DTensor step) reduces over the tensor ranks.
- The embedding is split by rows (vocabulary), the head by columns (vocabulary) with its logits left sharded
  for the vocabulary-parallel loss (`memtrain.strategies.tensor_parallel`).

A family whose plan uses another style (a packed or a replicated-with-reduce layer), a block module the plan
does not cover that holds weights (a per-head norm), or tied input and output embeddings is refused before
step 1 with the reason; so are degrees that do not divide the heads, KV heads, intermediate size or
vocabulary (`tensor_parallel_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memtrain.errors import Unsupported

STYLES = ("colwise", "rowwise")
"""transformers' plan styles this trainer maps to torch's (any other is refused by name)."""


def tensor_parallel_problems(config: Any, tp: int) -> list[str]:
    """One line per size of `config` that `tp` tensor ranks cannot split evenly, and per structure the plan
    cannot take (no transformers plan for the family, tied embeddings); empty for tp = 1."""
    if tp == 1:
        return []
    family = getattr(config, "model_type", type(config).__name__)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return [
            f"strategies.mesh.tp: transformers ships no tensor-parallel plan for {family}; set strategies.mesh.tp: 1"
        ]
    problems = [
        f"strategies.mesh.tp: {family}'s plan splits {name} as '{style}', which memtrain does not map to torch's "
        f"styles (it maps {', '.join(STYLES)}); set strategies.mesh.tp: 1"
        for name, style in plan.items()
        if style not in STYLES
    ]
    if getattr(config, "tie_word_embeddings", False):
        problems.append(
            f"strategies.mesh.tp: {family} ties its input and output embeddings, which tensor parallelism splits "
            "along different dimensions; set strategies.mesh.tp: 1 (or tie_word_embeddings: false in model.config)"
        )
    sizes = {
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
    }
    problems += [
        f"strategies.mesh.tp: {tp} does not divide the model's {name} ({value}); choose a tp that does"
        for name, value in sizes.items()
        if isinstance(value, int) and value % tp
    ]
    return problems


def causal_lm_plan(model: Any, sequence_parallel: bool) -> dict[str, Any]:
    """Module name -> torch `ParallelStyle` for a transformers causal LM (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    config = model.config
    problems = tensor_parallel_problems(config, 2)  # structure only: the sizes are checked with the degree
    structure = [p for p in problems if "does not divide" not in p]
    if structure:
        raise Unsupported(structure[0])
    base = getattr(model, "base_model_prefix", "model")
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {}
    for name, style in config.base_model_tp_plan.items():
        plan[f"{base}.{name}"] = (
            ColwiseParallel() if style == "colwise" else RowwiseParallel(output_layouts=between)
        )
    embedding, head = (
        _named(model, model.get_input_embeddings()),
        _named(model, model.get_output_embeddings()),
    )
    plan[embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    plan[head] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    plan.update(_block_plan(model, base, set(plan), SequenceParallel if sequence_parallel else None))
    return plan


def _block_plan(model: nn.Module, base: str, split: set[str], norm_style: Any) -> dict[str, Any]:
    """Checks every block's modules against the split linears (`Unsupported` for one with weights the plan
    leaves whole inside a split module, or beside it other than a norm: its gradient would differ per
    tensor rank) and, under sequence parallel (`norm_style`), returns the additions: the norms between the
    split linears, a gather before each module whose linears are split, the scatter into the first block."""
    blocks = _blocks(model, base)
    plan: dict[str, Any] = {}
    parents = {name.rsplit(".", 1)[0] for name in split}
    for block_name, block in blocks:
        for child_name, child in block.named_children():
            full = f"{block_name}.{child_name}"
            if any(parent == full for parent in _expanded(parents, block_name)):
                _check_covered(full, child, _expanded(split, block_name))
                plan[full] = _hook_style(_gather_sequence)
            elif _is_norm(child):
                plan[full] = norm_style() if norm_style is not None else None
            elif any(True for _ in child.parameters()):
                raise Unsupported(
                    f"strategies.mesh.tp: {full} ({type(child).__name__}) holds weights the tensor-parallel plan "
                    "does not split; set strategies.mesh.tp: 1"
                )
    if norm_style is None:
        return {}
    plan[blocks[0][0]] = _hook_style(_scatter_sequence)
    final_norm = f"{base}.norm"
    if _has_module(model, final_norm):
        plan[final_norm] = norm_style()
    return plan


def _expanded(names: set[str], block_name: str) -> set[str]:
    """`names` with the `*` of `layers.*` read as this block's index."""
    index = block_name.rsplit(".", 1)[1]
    return {name.replace("layers.*.", f"layers.{index}.") for name in names}


def _check_covered(name: str, module: nn.Module, split: set[str]) -> None:
    """Every weight inside a split attention or MLP module belongs to a split linear."""
    for child_name, child in module.named_modules():
        if child_name and not any(True for _ in child.children()) and any(True for _ in child.parameters()):
            if f"{name}.{child_name}" not in split:
                raise Unsupported(
                    f"strategies.mesh.tp: {name}.{child_name} ({type(child).__name__}) holds weights the "
                    "family's tensor-parallel plan does not split (its gradient would differ per tensor rank); "
                    "set strategies.mesh.tp: 1"
                )


def _blocks(model: nn.Module, base: str) -> list[tuple[str, nn.Module]]:
    layers = model.get_submodule(f"{base}.layers")
    return [(f"{base}.layers.{name}", block) for name, block in layers.named_children()]


def _is_norm(module: nn.Module) -> bool:
    """A norm: a leaf whose only parameters are a weight (and a bias) over the hidden size."""
    names = {name for name, _ in module.named_parameters()}
    return (
        not any(True for _ in module.children())
        and bool(names)
        and names <= {"weight", "bias"}
        and all(p.dim() == 1 for p in module.parameters())
    )


def _named(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _hidden_argument(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
    """transformers passes a module's hidden states first, by position or as `hidden_states`."""
    return (True, args[0]) if args else (False, kwargs["hidden_states"])


def _replace_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], value: torch.Tensor) -> tuple[Any, Any]:
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def _hook_style(make_hook: Any) -> Any:
    """A torch `ParallelStyle` that registers `make_hook(device_mesh)` as its module's forward pre-hook."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class HookStyle(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            module.register_forward_pre_hook(make_hook(device_mesh), with_kwargs=True)
            return module

    return HookStyle()


def _gather_sequence(device_mesh: Any) -> Any:
    """Before an attention or MLP module: its sequence-sharded input gathered whole, once for all its linears."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        _, hidden = _hidden_argument(args, kwargs)
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, device_mesh, [Shard(1)], run_check=False)
        return _replace_hidden(args, kwargs, hidden.redistribute(device_mesh, [Replicate()]).to_local())

    return gather


def _scatter_sequence(device_mesh: Any) -> Any:
    """Before the first block: the whole hidden states (the embedding's) cut to this rank's sequence shard."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def scatter(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        _, hidden = _hidden_argument(args, kwargs)
        whole = DTensor.from_local(hidden, device_mesh, [Replicate()], run_check=False)
        return _replace_hidden(args, kwargs, whole.redistribute(device_mesh, [Shard(1)]).to_local())

    return scatter
