"""Every kind's registry, in the order strategies are applied: the one vocabulary of strategy names.

The recipe schema, `memtrain plan`'s grid, the CLI help and docs/STRATEGIES.md read these. A strategy
in a module of its own joins by registering into its kind's registry; a built-in one is imported here
(one line), a user's registers from their own code before the recipe is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from memtrain.strategies.adapters import ADAPTERS
from memtrain.strategies.checkpointing import CHECKPOINTING
from memtrain.strategies.compile import COMPILE
from memtrain.strategies.loss import LOSS
from memtrain.strategies.micro_batching import MICRO_BATCHING
from memtrain.strategies.optimizer import OPTIMIZER_STATES
from memtrain.strategies.optimizer_step import OPTIMIZER_STEP
from memtrain.strategies.optimizers import OPTIMIZERS
from memtrain.strategies.precision import PRECISION
from memtrain.strategies.quantization import QUANTIZATION
from memtrain.strategies.registry import Registry
from memtrain.strategies.sharding import SHARDING

REGISTRIES: dict[str, Registry[Any]] = {
    "quantization": QUANTIZATION,
    "adapters": ADAPTERS,
    "precision": PRECISION,
    "checkpointing": CHECKPOINTING,
    "loss": LOSS,
    "compile": COMPILE,
    "optimizer": OPTIMIZERS,
    "optimizer_states": OPTIMIZER_STATES,
    "optimizer_step": OPTIMIZER_STEP,
    "sharding": SHARDING,
    "micro_batching": MICRO_BATCHING,
}

# Kinds a recipe chooses by name under `strategies:` (micro-batching comes from `batch:`, adapters from
# `adapters:`: they change the model, so the planner never chooses them; the optimizer from
# `optimizer.name`, among the names listed there only).
RECIPE_KINDS = (
    "precision",
    "checkpointing",
    "loss",
    "compile",
    "optimizer_states",
    "optimizer_step",
    "sharding",
)


def chosen_in(section: str) -> list[Registry[Any]]:
    """The registries whose kind a recipe chooses in `section` (strategies, adapters, model)."""
    return [r for r in REGISTRIES.values() if r.recipe is not None and r.recipe.section == section]


@dataclass(frozen=True)
class DeclaredKey:
    """A recipe key that strategies declare: a kind's choice or one of its options."""

    path: str
    default: Any
    doc: str
    changes_trajectory: bool


def declared_keys() -> list[DeclaredKey]:
    """Every recipe key the registries declare, each kind followed by its options."""
    keys = []
    for registry in REGISTRIES.values():
        kind = registry.recipe
        if kind is None:
            continue
        keys.append(
            DeclaredKey(f"{kind.section}.{kind.key}", kind.default, kind.doc, kind.changes_trajectory)
        )
        keys += [DeclaredKey(o.path, o.default, o.doc, o.changes_trajectory) for o in registry.options()]
    return keys


def free_keys() -> tuple[str, ...]:
    """The strategy keys a resume may change without changing the training (memory and speed only)."""
    return tuple(k.path for k in declared_keys() if not k.changes_trajectory)


def options_table() -> str:
    """The Markdown table of every declared key, as docs/STRATEGIES.md carries it
    (`python -m memtrain.strategies.catalog` prints it)."""
    rows = ["| key | default | on resume | what it does |", "|---|---|---|---|"]
    for key in declared_keys():
        resume = "changes the training" if key.changes_trajectory else "free (memory, speed)"
        doc = key.doc.replace("|", "\\|")
        rows.append(f"| `{key.path}` | `{json.dumps(key.default)}` | {resume} | {doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_table(), end="")
