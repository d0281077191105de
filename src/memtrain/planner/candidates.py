"""The candidate plans a recipe allows, and the reason each excluded option cannot run.

A recipe key that is pinned (`precision: bf16-mixed`) offers that one value, and a pinned value that
cannot run here is the user's error (`Unsupported` with the strategy's reason). A list offers its
entries; `auto` offers every registered name, except for precision, where `auto` means the precisions
that keep training numerically like fp32 — bf16-mixed (fp32 weights, gradients and optimizer; bf16
autocast) on a GPU with bf16, and fp32 — while bf16-master, fp16-mixed and fp8 change the numerics and are
only considered when listed. Options that fail their strategy's `check` leave the grid with the reason,
which `memtrain plan` shows.

Micro-batch sizes are the divisors of the per-rank batch (or the pinned size; with a token budget,
`batch.micro_tokens`, the whole per-rank batch packed under that budget). Checkpointing fractions are
`strategies.checkpointing_fraction` when `checkpointing: fraction` is pinned, else
`planner.checkpointing_fractions`; fractions that checkpoint the same number of blocks (or none, or all of
them) are dropped as duplicates.
With one rank, `auto` sharding is `none`: every other layout shards nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.plan import Plan, per_rank_batch, sharding_options
from memtrain.recipe import Recipe
from memtrain.strategies.checkpointing import NAMES as CHECKPOINTING_NAMES
from memtrain.strategies.checkpointing import Checkpointing
from memtrain.strategies.optimizer import OPTIMIZER_STATE_NAMES, OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding import make_sharding

NUMERICS_PRESERVING = ("bf16-mixed", "fp32")
MULTI_RANK_SHARDINGS = ("ddp", "zero1", "zero2", "zero3")


@dataclass(frozen=True)
class Candidate:
    precision: str
    checkpointing: str
    checkpointing_fraction: float
    optimizer_states: str
    sharding: str
    micro_batch_size: int
    accumulation_steps: int
    micro_batch_tokens: int | None = None  # the recipe's token budget per micro-batch (batch.micro_tokens)

    def tokens(self, seq_len: int) -> int:
        """Tokens of the largest micro-batch."""
        return self.micro_batch_tokens or self.micro_batch_size * seq_len

    def micro_steps(self, seq_len: int) -> int:
        """Micro-steps per step (with a token budget: at least, when every row is full length)."""
        rows = self.micro_batch_size * self.accumulation_steps
        return -(-rows * seq_len // self.tokens(seq_len))

    def plan(self, world_size: int) -> Plan:
        return Plan(precision=self.precision, checkpointing=self.checkpointing,
                    checkpointing_fraction=self.checkpointing_fraction, optimizer_states=self.optimizer_states,
                    sharding=self.sharding, micro_batch_size=self.micro_batch_size,
                    accumulation_steps=self.accumulation_steps, world_size=world_size,
                    micro_batch_tokens=self.micro_batch_tokens)


@dataclass(frozen=True)
class Grid:
    candidates: tuple[Candidate, ...]
    excluded: tuple[tuple[str, str], ...]  # (recipe key = value, why it cannot run here)


def build_grid(recipe: Recipe, device: torch.device, world_size: int, num_blocks: int, *,
               bf16: bool, fp8: bool, what_if: bool) -> Grid:
    """Every allowed combination that passes the strategies' checks. `what_if`: the device is described,
    not present, so the precision checks read `bf16` / `fp8` instead of asking CUDA."""
    s = recipe.strategies
    excluded: list[tuple[str, str]] = []
    env = DistEnv(rank=0, world_size=world_size, local_rank=0, device=device)

    def check_precision(name: str) -> None:
        if what_if:
            _what_if_precision(name, bf16, fp8, s.fp8_emulate)
        else:
            Precision(name, fp8_emulate=s.fp8_emulate).check(device)

    auto_precisions = NUMERICS_PRESERVING if device.type == "cuda" and bf16 else ("fp32",)
    precisions = _allowed("strategies.precision", s.precision, auto_precisions, check_precision, excluded)
    optimizers = _allowed("strategies.optimizer_states", s.optimizer_states, OPTIMIZER_STATE_NAMES,
                          lambda n: OptimizerStates(n).check(device), excluded)
    modes = _allowed("strategies.checkpointing", s.checkpointing, CHECKPOINTING_NAMES,
                     lambda n: Checkpointing(n, s.checkpointing_fraction if n == "fraction" else 1.0).check(device),
                     excluded)
    shardings_allowed = MULTI_RANK_SHARDINGS if world_size > 1 else ("none",)
    shardings = _allowed("strategies.sharding", s.sharding, shardings_allowed, lambda n: None, excluded)
    per_rank = per_rank_batch(recipe, world_size)
    micro = recipe.batch.micro_size
    if recipe.batch.micro_tokens is not None:
        sizes = [per_rank]
    elif isinstance(micro, int):
        sizes = [micro]
    else:
        sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    checkpointing = _checkpointing_options(recipe, modes, num_blocks)
    candidates = []
    for precision in precisions:
        for sharding in shardings:
            try:
                make_sharding(sharding, **sharding_options(recipe, precision)).check(env)
            except Unsupported as exc:
                if _pinned(s.sharding) and _pinned(s.precision):
                    raise
                excluded.append((f"strategies.sharding={sharding} with precision {precision}", str(exc)))
                continue
            for mode, fraction in checkpointing:
                for optimizer in optimizers:
                    for size in sizes:
                        candidates.append(Candidate(precision, mode, fraction, optimizer, sharding, size,
                                                    per_rank // size, recipe.batch.micro_tokens))
    return Grid(tuple(candidates), tuple(excluded))


def _checkpointing_options(recipe: Recipe, modes: Sequence[str], num_blocks: int) -> list[tuple[str, float]]:
    s = recipe.strategies
    fractions = [s.checkpointing_fraction] if _pinned(s.checkpointing) else list(recipe.planner.checkpointing_fractions)
    options: list[tuple[str, float]] = []
    counts: set[int] = set()
    for mode in modes:
        if mode != "fraction":
            options.append((mode, 1.0))
            continue
        for fraction in fractions:
            count = sum(Checkpointing("fraction", fraction).checkpointed(num_blocks))
            duplicate = count in counts or (count == 0 and "none" in modes) or (count == num_blocks and "full" in modes)
            if not duplicate or _pinned(s.checkpointing):
                counts.add(count)
                options.append(("fraction", fraction))
    return options


def _allowed(key: str, value: str | list[str], auto: Sequence[str], check: Callable[[str], None],
             excluded: list[tuple[str, str]]) -> list[str]:
    names = list(auto) if value == "auto" else [value] if isinstance(value, str) else list(value)
    allowed = []
    for name in names:
        try:
            check(name)
            allowed.append(name)
        except Unsupported as exc:
            if _pinned(value):
                raise
            excluded.append((f"{key}={name}", str(exc)))
    if not allowed:
        raise Unsupported(f"{key}: none of {names} can run here: " + "; ".join(r for _, r in excluded[-len(names):]))
    return allowed


def _pinned(value: str | list[str]) -> bool:
    return isinstance(value, str) and value != "auto"


def _what_if_precision(name: str, bf16: bool, fp8: bool, emulate: bool) -> None:
    if name in ("bf16-mixed", "bf16-master", "fp8") and not bf16:
        raise Unsupported(f"strategies.precision: {name} needs a GPU with bf16 (compute capability >= 8.0); "
                          "use fp16-mixed or fp32")
    if name == "fp8":
        Precision(name, fp8_emulate=True).check(torch.device("cpu"))  # torchao importable
        if not (fp8 or emulate):
            raise Unsupported("strategies.precision: fp8 needs compute capability >= 8.9 (H100, L4, RTX 4090); "
                              "use bf16-mixed")
