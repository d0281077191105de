"""transformers' own checkpoints in the model's parameter names: the key mapping `from_pretrained` applies.

Why: transformers 5 builds some families with fused or renamed parameters (a MoE layer's experts as one
`experts.gate_up_proj` tensor; GPT-NeoX's head as `lm_head`) and `save_pretrained` writes them back in the
published layout (one tensor per expert, `experts.0.w1.weight`; `embed_out.weight`), so a checkpoint's names
are not the model's. Each checkpoint name is mapped as `from_pretrained` maps it, with transformers' own
conversion mapping of the model (`get_model_conversion_mapping`: its renamings, then at most one converter),
so memtrain reads whatever layout transformers reads. A renamed parameter is still read a block at a time
(`pretrained.load_weights`); a converted one, whose tensor is built from several (the experts stacked, gate
and up concatenated), is built by the converter's own operations, one parameter at a time: from this rank's
experts alone where the converter stacks experts along dimension 0 (`stacks_experts`: a rank of FSDP's
dim-0 shards reads its own experts' tensors), whole otherwise, and each rank copies its block of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Source:
    """Where a parameter's values are: checkpoint tensors (in transformers' order), and the converter that
    builds the parameter from them (None: the one tensor, under another name or its own)."""

    keys: list[str] = field(default_factory=list)
    patterns: list[str] = field(default_factory=list)
    converter: Any = None

    def stacks_experts(self, experts: int) -> bool:
        """Whether the converter stacks `experts` tensors of each source pattern along dimension 0 into one
        target (then at most concatenates the patterns along a later dimension): row i of the parameter is
        built from the i-th tensor of each pattern alone."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        operations = list(getattr(self.converter, "operations", []))
        first, rest = (operations[0], operations[1:]) if operations else (None, [])
        return (
            isinstance(first, MergeModulelist)
            and first.dim == 0
            and all(isinstance(op, Concatenate) and op.dim >= 1 for op in rest)
            and len(self.converter.target_patterns) == 1
            and all(self.patterns.count(p) == experts for p in set(self.patterns))
        )

    def convert(
        self,
        target: str,
        read: Callable[[str], torch.Tensor],
        model: nn.Module,
        rows: slice | None = None,
    ) -> dict[str, torch.Tensor]:
        """The parameters the converter builds from the checkpoint tensors (several for a one-to-many
        converter, e.g. a fused qkv split), by their names in the model. With `rows` (`stacks_experts`
        only): those experts' tensors alone are read, and the tensor built holds those rows alone."""
        converter = copy.deepcopy(self.converter)
        pairs = list(zip(self.keys, self.patterns, strict=True))
        if rows is not None:  # each pattern's tensors are in expert order (`sources` sorts them)
            pairs = [
                pair for p in dict.fromkeys(self.patterns) for pair in [q for q in pairs if q[1] == p][rows]
            ]
        for key, pattern in pairs:
            converter.add_tensor(target, key, pattern, lambda key=key: read(key))
        built = converter.convert(target, model=model, config=getattr(model, "config", None))
        return {name: value[0] if isinstance(value, list) else value for name, value in built.items()}


def sources(model: nn.Module, names: Iterable[str], checkpoint: Iterable[str]) -> dict[str, Source]:
    """Parameter name -> its `Source`, for every checkpoint tensor that maps to one of `names` (the model's
    parameters by their checkpoint names); a converter's entry is under its first target."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    hf = _transformers_model(model)
    mapping = _conversion_mapping(hf) if hf is not None else []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    known = dict.fromkeys(names, True)
    prefix = getattr(hf, "base_model_prefix", None)
    found: dict[str, Source] = {}
    for key in sorted(checkpoint, key=dot_natural_key):  # transformers' order: experts 0, 1, ..., 10
        target, pattern = (
            (key, None) if key in known else rename_source_key(key, renamings, converters, prefix, known)
        )
        if target not in known:
            continue
        entry = found.setdefault(target, Source(converter=by_pattern.get(pattern) if pattern else None))
        entry.keys.append(key)
        entry.patterns.append(pattern or key)
    return found


def _transformers_model(model: nn.Module) -> Any:
    """The outermost transformers model in `model` (wrappers' own classes around it), or None."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _conversion_mapping(model: Any) -> list[Any]:
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))
