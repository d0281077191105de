"""The trainer's state in a checkpoint: what a rank writes into one, and loads back from one.

Why apart from the loop and the run directory: the run directory (`memtrain.run`) decides *when* and
*where* a checkpoint is staged, committed, pruned or picked for a resume, and knows nothing of models;
the sharding backend writes the model and optimizer in its own format. This module is the glue of one
checkpoint's contents: the backend's files, the fp16 grad scaler, each rank's random streams, and the
micro-batching an out-of-memory recovery chose before the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain import checkpoint as tensor_files
from memtrain.distributed import DistEnv
from memtrain.plan import Plan
from memtrain.recipe import Recipe
from memtrain.run import CheckpointFiles
from memtrain.run.checkpoints import Checkpoint
from memtrain.strategies.sharding import sharded_checkpoint
from memtrain.strategies.sharding.base import ShardingBackend


@dataclass(frozen=True)
class TrainerState:
    """The live objects whose state a checkpoint holds."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    sharding: ShardingBackend
    env: DistEnv

    def write(self, files: CheckpointFiles) -> None:
        """This rank's share of a checkpoint being staged in `files`."""
        self.sharding.save(files.path, self.model, self.optimizer, self.env)
        if self.env.is_main and self.scaler is not None:
            tensor_files.save_tensor_file(files.grad_scaler, self.scaler.state_dict())
        tensor_files.save_tensor_file(files.rng(self.env.rank), tensor_files.rng_state())

    def load(self, found: Checkpoint) -> None:
        """Load `found` into the live model, optimizer, scaler and random streams (`CheckpointError`
        naming the file that does not fit). Only the format its manifest names is read: files of another
        format in it (not written by memtrain) refuse the checkpoint before anything is opened. The random
        streams are per rank: on more ranks than wrote it, a rank without its own file takes rank 0's; on
        fewer, the others' are unread. Neither moves the data, whose order is a function of the step."""
        sharded_checkpoint.detect_format(found.path, found.meta.get(sharded_checkpoint.MANIFEST_KEY))
        try:
            self.sharding.load(found.path, self.model, self.optimizer, self.env)
        except (KeyError, IndexError, TypeError, ValueError) as exc:  # e.g. another optimizer's state
            raise tensor_files.CheckpointError(
                f"{found.path}: does not fit this run ({type(exc).__name__}: {exc})"
            ) from None
        files = found.files
        if self.scaler is not None:
            self.scaler.load_state_dict(tensor_files.load_tensor_file(files.grad_scaler))
        rng_file = files.rng(self.env.rank)
        tensor_files.load_rng_state(rng_file if rng_file.is_file() else files.rng(0))


def adopt_saved_micro_batch(plan: Plan, meta: dict[str, Any], world_size: int) -> Plan:
    """`plan` with the smaller micro-batches an out-of-memory recovery chose before the checkpoint whose
    meta.json is `meta` (same world size and micro-batching kind), else `plan` itself."""
    saved = meta.get("plan", {})
    try:
        micro = Plan.from_dict(saved).micro_batching
    except ValueError:
        return plan  # an older layout of plan metadata: keep this run's plan
    current = plan.micro_batching
    if (
        saved.get("world_size") == world_size
        and type(micro) is type(current)
        and micro.rows == current.rows
        and micro.tokens(1) < current.tokens(1)
    ):
        return plan.replace(micro_batching=micro)
    return plan


def checkpoint_meta(
    recipe: Recipe, plan: Plan, world_size: int, skipped_steps: int, checkpoint_format: str
) -> dict[str, Any]:
    """What meta.json says about the trainer (the run directory adds the step, lineage and time), with the
    manifest: the backend's `checkpoint_format_on(env)`, the only format a resume or an export of it reads."""
    resolved = recipe.to_dict()
    return {
        sharded_checkpoint.MANIFEST_KEY: checkpoint_format,
        "world_size": world_size,
        "plan": plan.to_dict(),
        "recipe_fingerprint": recipe.fingerprint(),
        "recipe": resolved,  # what a resume compares its recipe with (lineage.check_recipe)
        "skipped_steps": skipped_steps,
        "model_section": resolved["model"],
    }
