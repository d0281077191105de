"""Adapters: train small added weights on a frozen base model (LoRA), the memory strategy of fine-tuning.

A frozen base has no gradients and no optimizer states: only the adapters' parameters get them, which is
what the planner's arithmetic counts (every estimate reads `ParamInfo.trainable`). Adapters change the
model, so the planner never turns them on by itself: the recipe's `adapters:` section chooses them, and
the planner plans within them.

`lora` injects peft's LoRA layers into the chosen linear layers in place (`peft.inject_adapter_in_model`:
no wrapper model, so the trainer's blocks, hooks and loss see the same module tree), then freezes every
parameter that is not an adapter's. On a model whose parameters are still on the meta device (pretrained
weights not read yet), the adapters are created there too and initialised by `initialise` once the
parameters are materialised; `owns(name)` tells the weight loader which parameters a checkpoint of the
base model does not have.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from memtrain.errors import Unsupported
from memtrain.strategies.blocks import output_head
from memtrain.strategies.registry import DeviceFacts, RecipeKey, Registry, Strategy, option

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Adapters(Strategy):
    """`none`: every parameter trains as the model defines it."""

    kind: ClassVar[str] = "adapters"
    name: ClassVar[str] = "none"

    def apply(self, model: nn.Module) -> None:
        """Add the adapters to `model` in place and freeze what they leave frozen."""

    def owns(self, parameter_name: str) -> bool:
        """Whether a parameter is one of the adapters' (absent from the base model's checkpoint)."""
        return False

    def initialise(self, model: nn.Module) -> None:
        """Initialise the adapters' parameters after a meta-device model was materialised."""


ADAPTERS: Registry[Adapters] = Registry(
    "adapters",
    Adapters,
    RecipeKey(
        "adapters",
        "kind",
        "none",
        "Parameter-efficient fine-tuning: none, or lora (peft adapters on a frozen base).",
        changes_trajectory=True,
        planner_choice=False,
    ),
)
ADAPTERS.register(Adapters)


@ADAPTERS.register
@dataclass(frozen=True)
class LoRA(Adapters):
    """Low-rank adapters (peft): W x + (alpha / r) B A x, with A (r x in) and B (out x r) trained."""

    name: ClassVar[str] = "lora"
    r: int = option(16, recipe_key="r", doc="LoRA rank.", changes_trajectory=True, gt=0)
    alpha: float = option(
        32.0,
        recipe_key="alpha",
        doc="LoRA scale numerator (the update is scaled by alpha / r).",
        changes_trajectory=True,
        gt=0,
    )
    dropout: float = option(
        0.0,
        recipe_key="dropout",
        doc="Dropout on the adapters' input.",
        changes_trajectory=True,
        ge=0.0,
        lt=1.0,
    )
    target_modules: tuple[str, ...] | str = option(
        ALL_LINEAR,
        recipe_key="target_modules",
        recipe_type=list[str] | Literal["all-linear"],
        doc="Module names (suffixes) to adapt, or all-linear (every linear but the head).",
        changes_trajectory=True,
    )

    def check(self, facts: DeviceFacts) -> None:
        if importlib.util.find_spec("peft") is None:
            raise Unsupported("adapters.kind: lora needs peft; pip install 'memtrain[lora]'")

    def apply(self, model: nn.Module) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        targets = self.target_modules
        if isinstance(targets, tuple):
            check_targets(model, targets)
        config = LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,  # type: ignore[arg-type]  # typed int by peft; the scale alpha / r takes a float
            lora_dropout=self.dropout,
            target_modules=list(targets) if isinstance(targets, tuple) else targets,
            exclude_modules=[head] if (head := output_head(model)) else [],
        )
        try:  # created on the meta device, then placed by `initialise`: peft's `.to` cannot move fake tensors
            with torch.device("meta"):
                inject_adapter_in_model(config, model)
        except ValueError as exc:  # peft: "Target modules ... not found in the base model"
            raise Unsupported(f"adapters.target_modules: {exc}") from None
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(self.owns(name))
        if not any(p.is_meta for name, p in model.named_parameters() if not self.owns(name)):
            self.initialise(model)

    def owns(self, parameter_name: str) -> bool:
        return ".lora_" in parameter_name

    def describe(self) -> str:
        """Each option named, the rank and alpha always (the default `describe` lists the changed values
        alone, so a dropout of 0.05 read as a rank): `lora(r=16, alpha=32, dropout=0.05)`."""
        named = [f"r={self.r}", f"alpha={self.alpha:g}"]
        named += [f"dropout={self.dropout:g}"] if self.dropout else []
        targets = self.target_modules
        named += [f"targets={'+'.join(targets)}"] if isinstance(targets, tuple) else []
        return f"{self.name}({', '.join(named)})"

    def initialise(self, model: nn.Module) -> None:
        """Storage next to each adapted layer's weight (its device; the adapter's own dtype, which is the
        trainable parameters' while the frozen base may be stored in the compute dtype), then peft's LoRA
        init (A random, B zero: the adapted model starts as the base model)."""
        for module in model.modules():
            reset = getattr(module, "reset_lora_parameters", None)
            adapters: Any = getattr(module, "lora_A", None)
            base: Any = getattr(module, "base_layer", None)
            if not (callable(reset) and isinstance(adapters, nn.ModuleDict) and base is not None):
                continue
            weight = base.weight
            lora_b: Any = getattr(module, "lora_B", None)
            for layer in (*adapters.values(), *lora_b.values()):
                for key, parameter in list(layer._parameters.items()):
                    if parameter is not None and (parameter.is_meta or parameter.device != weight.device):
                        empty = torch.empty(parameter.shape, dtype=parameter.dtype, device=weight.device)
                        layer._parameters[key] = nn.Parameter(empty, requires_grad=parameter.requires_grad)
            for adapter in list(adapters.keys()):
                reset(adapter, True)


def check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """`Unsupported` naming every target that matches no module: peft adapts the targets that match and
    ignores the others, so a misspelt name would train with fewer adapters than the recipe asked for."""
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        leaves = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise Unsupported(
            f"adapters.target_modules: {', '.join(map(repr, unmatched))} match no module of the model "
            f"(its linear layers: {', '.join(leaves[:12])}{', ...' if len(leaves) > 12 else ''})"
        )
