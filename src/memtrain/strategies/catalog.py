"""Every kind's registry, in the order strategies are applied: the one vocabulary of strategy names.

The recipe schema, `memtrain plan`'s grid, the CLI help and docs/STRATEGIES.md read these. A strategy
in a module of its own joins by registering into its kind's registry; a built-in one is imported here
(one line), a user's registers from their own code before the recipe is loaded.
"""

from __future__ import annotations

from typing import Any

from memtrain.strategies.adapters import ADAPTERS
from memtrain.strategies.checkpointing import CHECKPOINTING
from memtrain.strategies.loss import LOSS
from memtrain.strategies.micro_batching import MICRO_BATCHING
from memtrain.strategies.optimizer import OPTIMIZER_STATES
from memtrain.strategies.optimizer_step import OPTIMIZER_STEP
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
    "optimizer_states": OPTIMIZER_STATES,
    "optimizer_step": OPTIMIZER_STEP,
    "sharding": SHARDING,
    "micro_batching": MICRO_BATCHING,
}

# Kinds a recipe chooses by name under `strategies:` (micro-batching comes from `batch:`, adapters from
# `adapters:`: they change the model, so the planner never chooses them).
RECIPE_KINDS = ("precision", "checkpointing", "loss", "optimizer_states", "optimizer_step", "sharding")
