"""The candidate plans a recipe allows, and the reason each excluded option cannot run.

The names come from the strategy registries (`memtrain.strategies.catalog`), never from lists here. A
recipe key that is pinned (`precision: bf16-mixed`) offers that one strategy, and a pinned strategy that
cannot run here is the user's error (`Unsupported` with the strategy's reason). A list offers its entries;
`auto` offers every registered name, except for precision, where `auto` means the precisions that keep
training numerically like fp32 (`preserves_numerics`) and, off CUDA, without autocast (bf16 autocast is
slower than fp32 on a CPU): bf16-mixed and fp32 on a GPU with bf16, fp32 elsewhere. Options that fail
their strategy's `check` leave the grid with the reason, which `memtrain plan` shows.

Micro-batch sizes are the divisors of the per-rank batch (or the pinned size; with a token budget,
`batch.micro_tokens`, the whole per-rank batch packed under that budget). Checkpointing strategies with a
knob offer their `search_variants` (`fraction`: `strategies.checkpointing_fraction` when pinned, else
`planner.checkpointing_fractions`); variants that recompute the same blocks as another candidate are
dropped as duplicates. With one rank, `auto` sharding is `none`: every other layout shards nothing there.
A loss that cannot run with a sharding (`chunked` on DeepSpeed ZeRO-3) leaves the grid for that sharding.
A quantised base leaves out every sharding that cannot hold it (zero1, DeepSpeed; FSDP2's zero2/zero3 shard
it: `Quantization.check_sharding`, which `pinned_plan` applies too). `planner.rules` builds this grid for `memtrain validate`: when the rules leave
no candidate, validate names them.
The optimizers are the ones `optimizer.name` lists (never more: the optimizer changes the training), each
with the state formats and shardings it can run with (`Optimizer.check_with`) and under the precision
(`Precision.update_states`: bf16-true steps AdamW only); the others are excluded with the reason.
An optimizer step in backward is offered only where it is exact (one micro-step per step, no gradient
clipping, no sharding, no loss scaling or master copy: `OptimizerStep.check_plan`); pinned, and exact
nowhere, it is the user's error.

Sharding options the recipe leaves open multiply the layouts (`Sharding.choices`): `sharding_offload`
`auto` offers each offload the backend supports (a list, each listed one, those that cannot run
excluded with the backend's reason), and `gradient_reduction` `auto` each reduction the backend can run
(only with accumulation: on one micro-step per step the two are the same plan). Offload is a GPU's: on
a CPU target the host is the device, so an open offload offers only `none` there, with the reason. On one
GPU, an open offload with `sharding: auto` also offers the ZeRO stages with offload (a stage without
offload shards nothing on one rank), so a model whose states do not fit on one GPU can still train.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.plan import (
    Plan,
    adapters_of,
    micro_batching,
    optimizer_of,
    per_rank_batch,
    quantization_of,
    recipe_strategy,
)
from memtrain.recipe import Recipe
from memtrain.strategies.catalog import REGISTRIES
from memtrain.strategies.checkpointing import Checkpointing, NoCheckpointing
from memtrain.strategies.compile import Compile
from memtrain.strategies.loss import Loss
from memtrain.strategies.micro_batching import MicroBatching
from memtrain.strategies.optimizer import OptimizerStates, PagedEightBitStates
from memtrain.strategies.optimizer_step import OptimizerStep
from memtrain.strategies.optimizers import Optimizer
from memtrain.strategies.precision import PRECISION, Precision
from memtrain.strategies.registry import DeviceFacts
from memtrain.strategies.sharding import SHARDING, Sharding


@dataclass(frozen=True)
class Grid:
    candidates: tuple[Plan, ...]
    excluded: tuple[tuple[str, str], ...]  # (recipe key = value, why it cannot run here)


def build_grid(recipe: Recipe, facts: DeviceFacts, device: torch.device, num_blocks: int) -> Grid:
    """Every allowed combination that passes the strategies' checks on `facts` (a device present, or one
    a what-if describes)."""
    s = recipe.strategies
    excluded: list[tuple[str, str]] = []
    world_size = facts.world_size
    env = DistEnv(rank=0, world_size=world_size, local_rank=0, device=device, mesh=facts.mesh)

    def allowed(kind: str, auto: Sequence[str]) -> list[Any]:
        value = getattr(s, kind)
        names = list(auto) if value == "auto" else [value] if isinstance(value, str) else list(value)
        return _allowed(
            f"strategies.{kind}", value, [recipe_strategy(recipe, kind, n) for n in names], facts, excluded
        )

    adapters, quantization = adapters_of(recipe), quantization_of(recipe)
    adapters.check(facts)  # the recipe's choices: one that cannot run is the user's error
    quantization.check(facts)
    precisions = allowed("precision", _auto_precisions(facts))
    optimizers = allowed("optimizer_states", REGISTRIES["optimizer_states"].names())
    modes = allowed("checkpointing", REGISTRIES["checkpointing"].names())
    losses = allowed("loss", REGISTRIES["loss"].names())
    steps = allowed("optimizer_step", REGISTRIES["optimizer_step"].names())
    compiles = allowed("compile", REGISTRIES["compile"].names())
    name = recipe.optimizer.name
    updates = _allowed(
        "optimizer.name", name, [optimizer_of(recipe, n) for n in _names(name)], facts, excluded
    )
    refused: list[Unsupported] = []
    multi_rank = tuple(cls.name for cls in SHARDING if cls.multi_rank) if env.dp_size > 1 else ("none",)
    shardings = _allowed(
        "strategies.sharding",
        s.sharding,
        [
            recipe_strategy(recipe, "sharding", n)
            for n in (
                multi_rank
                if s.sharding == "auto"
                else [s.sharding]
                if isinstance(s.sharding, str)
                else s.sharding
            )
        ],
        facts,
        excluded,
        check=lambda _strategy: None,
    )
    shardings = _sharding_choices(recipe, shardings, facts, excluded)
    per_rank = per_rank_batch(recipe, env.dp_size)
    micro = recipe.batch.micro_size
    if recipe.batch.micro_tokens is not None:
        sizes = [per_rank]
    elif isinstance(micro, int):
        sizes = [micro]
    else:
        sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    checkpointing = _checkpointing_options(recipe, modes, num_blocks, excluded)
    candidates = []
    for precision in precisions:
        for sharding in shardings:
            try:
                quantization.check_sharding(sharding)
            except Unsupported as exc:
                if (reason := (f"strategies.sharding={sharding.name}", str(exc))) not in excluded:
                    excluded.append(reason)
                continue
            try:
                sharding.check_with(env, precision)
            except Unsupported as exc:
                if _pinned(s.sharding) and _pinned(s.precision) and _pinned(s.sharding_offload):
                    raise
                excluded.append(
                    (f"strategies.sharding={sharding.describe()} with precision {precision.name}", str(exc))
                )
                continue
            # with one micro-step per step, every reduction is the backend's own: one candidate
            single_only = (
                s.gradient_reduction == "auto" and sharding.gradient_reduction != sharding.own_reduction()
            )
            for loss in _with_sharding(losses, sharding, _pinned(s.loss) and _pinned(s.sharding), excluded):
                for mode in checkpointing:
                    for optimizer in optimizers:
                        if sharding.offload != "none" and isinstance(optimizer, PagedEightBitStates):
                            reason = (
                                f"strategies.optimizer_states=paged-8bit with sharding_offload={sharding.offload}",
                                "paged states live in CUDA unified memory, for parameters on the device; "
                                "offload steps the optimizer on host tensors",
                            )
                            if reason not in excluded:
                                excluded.append(reason)
                            continue
                        for size in sizes:
                            if single_only and recipe.batch.micro_tokens is None and size == per_rank:
                                continue
                            batching = micro_batching(recipe, per_rank, size)
                            for step in _exact_steps(steps, batching, recipe, sharding, precision, refused):
                                candidates += [
                                    Plan(
                                        precision,
                                        mode,
                                        optimizer,
                                        sharding,
                                        batching,
                                        world_size,
                                        adapters,
                                        quantization,
                                        loss,
                                        step,
                                        update,
                                        facts.mesh,
                                        compiled,
                                    )
                                    for update in _updates_with(
                                        recipe, updates, optimizer, sharding, step, precision, excluded
                                    )
                                    for compiled in _compiles_with(recipe, compiles, mode, sharding, excluded)
                                ]
    if refused and _pinned(s.optimizer_step) and not candidates:
        raise refused[0]
    for refusal in refused:
        reason = ("strategies.optimizer_step=in_backward", str(refusal).split(": ", 1)[-1])
        if reason not in excluded:
            excluded.append(reason)
    return Grid(tuple(candidates), tuple(excluded))


def _exact_steps(
    steps: Sequence[OptimizerStep],
    batching: MicroBatching,
    recipe: Recipe,
    sharding: Sharding,
    precision: Precision,
    refused: list[Unsupported],
) -> list[OptimizerStep]:
    """The optimizer steps that are exact with these choices; the others' reasons go to `refused`."""
    kept = []
    for step in steps:
        try:
            step.check_plan(
                batching=batching, grad_clip=recipe.train.grad_clip, sharding=sharding, precision=precision
            )
            kept.append(step)
        except Unsupported as exc:
            if all(str(exc) != str(r) for r in refused):
                refused.append(exc)
    return kept


def _compiles_with(
    recipe: Recipe,
    compiles: Sequence[Compile],
    mode: Checkpointing,
    sharding: Sharding,
    excluded: list[tuple[str, str]],
) -> list[Compile]:
    """The compile choices that can run with this checkpointing and sharding (pinned and not: the user's
    error)."""
    s = recipe.strategies
    pinned = _pinned(s.compile) and _pinned(s.checkpointing) and _pinned(s.sharding)
    kept = []
    for compiled in compiles:
        try:
            compiled.check_with(mode, sharding)
            kept.append(compiled)
        except Unsupported as exc:
            if pinned:
                raise
            reason = (f"strategies.compile={compiled.name} with {mode.name}, {sharding.describe()}", str(exc))
            if reason not in excluded:
                excluded.append(reason)
    return kept


def _updates_with(
    recipe: Recipe,
    updates: Sequence[Optimizer],
    states: OptimizerStates,
    sharding: Sharding,
    step: OptimizerStep,
    precision: Precision,
    excluded: list[tuple[str, str]],
) -> list[Optimizer]:
    """The optimizers that can run with this state format, sharding, optimizer step and precision (when
    the recipe pins them all and they cannot, the user's error)."""
    s = recipe.strategies
    choices = (recipe.optimizer.name, s.optimizer_states, s.sharding, s.optimizer_step, s.precision)
    pinned = all(_pinned(choice) for choice in choices)
    kept = []
    for update in updates:
        try:
            update.check_with(states, sharding, step.in_backward)
            precision.update_states(states, update.name)
            kept.append(update)
        except Unsupported as exc:
            if pinned:
                raise
            reason = (
                f"optimizer.name={update.name} with {states.name} states, sharding {sharding.name}, "
                f"precision {precision.name}",
                str(exc),
            )
            if reason not in excluded:
                excluded.append(reason)
    return kept


def _names(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _sharding_choices(
    recipe: Recipe, layouts: Sequence[Sharding], facts: DeviceFacts, excluded: list[tuple[str, str]]
) -> list[Sharding]:
    """The concrete shardings of the allowed layouts: each with the offloads and reductions the recipe
    leaves open (see the module docstring)."""
    s = recipe.strategies
    offload_open = not _pinned(s.sharding_offload)
    offered = list(layouts)
    one_gpu = facts.world_size == 1 and s.sharding == "auto" and facts.device_type == "cuda"
    if one_gpu and offload_open:
        offered += [SHARDING.create(cls.name, s.model_dump()) for cls in SHARDING if not cls.replicated]
    choices = []
    for layout in offered:
        for choice in layout.choices():
            if choice.offload == "none" and one_gpu and not choice.replicated:
                continue  # a ZeRO stage offered for its offload only
            if choice.offload != "none" and offload_open and facts.device_type != "cuda":
                reason = (
                    f"strategies.sharding_offload={choice.offload}",
                    f"offload moves states to host memory, which on a {facts.device_type} device is the device's "
                    "own memory: it saves nothing there",
                )
                if reason not in excluded:
                    excluded.append(reason)
                continue
            choices.append(choice)
    return choices


def _with_sharding(
    losses: Sequence[Loss], sharding: Sharding, pinned: bool, excluded: list[tuple[str, str]]
) -> list[Loss]:
    """The losses that can run with `sharding` (a pinned pair that cannot is the user's error)."""
    kept = []
    for loss in losses:
        try:
            loss.check_sharding(sharding)
            kept.append(loss)
        except Unsupported as exc:
            if pinned:
                raise
            reason = (f"strategies.loss={loss.name} with sharding {sharding.name}", str(exc))
            if reason not in excluded:
                excluded.append(reason)
    return kept


def _auto_precisions(facts: DeviceFacts) -> list[str]:
    return [
        cls.name
        for cls in PRECISION
        if cls.preserves_numerics
        and (cls.autocast_dtype is None or (facts.device_type == "cuda" and facts.bf16))
    ]


def _checkpointing_options(
    recipe: Recipe, modes: Sequence[Checkpointing], num_blocks: int, excluded: list[tuple[str, str]]
) -> list[Checkpointing]:
    """Each allowed mode's variants; a variant whose blocks run exactly as those of a mode already offered
    (or of another variant) is a duplicate (a pinned mode has one variant, itself). A model without blocks
    (`Trainer.blocks` found none) has nothing to recompute or offload: only `none` is offered."""
    if num_blocks == 0:
        return _without_blocks(modes, excluded)
    pinned = _pinned(recipe.strategies.checkpointing)
    fractions = tuple(recipe.planner.checkpointing_fractions)

    def runs(mode: Checkpointing) -> tuple[Checkpointing, ...]:
        return mode.block_modes(num_blocks, "cuda")

    seen = {runs(m) for m in modes if len(m.search_variants(fractions, pinned)) == 1}
    options: list[Checkpointing] = []
    for mode in modes:
        variants = mode.search_variants(fractions, pinned)
        if len(variants) == 1:
            options.append(variants[0])
            continue
        for variant in variants:
            blocks = runs(variant)
            if blocks not in seen:
                seen.add(blocks)
                options.append(variant)
    return options


def _without_blocks(modes: Sequence[Checkpointing], excluded: list[tuple[str, str]]) -> list[Checkpointing]:
    why = (
        "the model has no repeated blocks to checkpoint (Trainer.blocks(model) found none: override it to "
        "name them)"
    )
    kept: list[Checkpointing] = [mode for mode in modes if mode == NoCheckpointing()]
    excluded.extend((f"strategies.checkpointing={mode.name}", why) for mode in modes if mode not in kept)
    if not kept:
        names = ", ".join(mode.name for mode in modes)
        raise Unsupported(f"strategies.checkpointing={names}: {why}; set strategies.checkpointing: none")
    return kept


def _allowed(
    key: str,
    value: str | list[str],
    strategies: list[Any],
    facts: DeviceFacts,
    excluded: list[tuple[str, str]],
    check: Callable[[Any], None] | None = None,
) -> list[Any]:
    allowed = []
    for strategy in strategies:
        try:
            (check or (lambda s: s.check(facts)))(strategy)
            allowed.append(strategy)
        except Unsupported as exc:
            if _pinned(value):
                raise
            excluded.append((f"{key}={strategy.name}", str(exc)))
    if not allowed:
        names = [s.name for s in strategies]
        raise Unsupported(
            f"{key}: none of {names} can run here: " + "; ".join(r for _, r in excluded[-len(names) :])
        )
    return allowed


def _pinned(value: object) -> bool:
    return isinstance(value, str) and value != "auto"
