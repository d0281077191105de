"""`Plan`: the frozen set of strategies a run trains with, and the plan of a recipe that pins every choice.

A recipe may leave choices open (`auto`, a list of allowed names, `batch.micro_size: auto`); then the
planner (`memtrain.planner.make_plan`) predicts every allowed combination and picks one. A recipe that
pins every choice skips the planner: `pinned_plan` checks each strategy (`Unsupported` with the strategy's
reason when one cannot run here) and uses them as they are.

A Plan holds strategy objects, not names: the trainer applies them (`strategies.apply`), the memory and
step-time models read their facts, and `to_dict` / `from_dict` carry them through plan.json and
checkpoint metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError, Unsupported
from memtrain.mesh import DIMS, MeshShape, resolve
from memtrain.recipe import Recipe
from memtrain.strategies.adapters import ADAPTERS, Adapters
from memtrain.strategies.catalog import RECIPE_KINDS, REGISTRIES
from memtrain.strategies.checkpointing import CHECKPOINTING, Checkpointing
from memtrain.strategies.compile import COMPILE, Compile
from memtrain.strategies.context_parallel import RING_ATTENTION_DEVICES
from memtrain.strategies.loss import LOSS, Loss
from memtrain.strategies.micro_batching import MicroBatching, TokenBudget
from memtrain.strategies.optimizer import OPTIMIZER_STATES, OptimizerStates
from memtrain.strategies.optimizer_step import OPTIMIZER_STEP, OptimizerStep
from memtrain.strategies.optimizers import OPTIMIZERS, Optimizer
from memtrain.strategies.precision import PRECISION, Precision
from memtrain.strategies.quantization import QUANTIZATION, Quantization
from memtrain.strategies.registry import DeviceFacts, Strategy
from memtrain.strategies.sharding import SHARDING, Sharding
from memtrain.strategies.sharding.base import ShardingBackend

OPTIONAL_KINDS = ("quantization", "adapters")  # change the recipe's model: "none" unless it asks
LATER_KINDS = (
    "loss",
    "optimizer_step",
    "optimizer",
    "compile",
)  # plans written before these kinds ran their defaults


@dataclass(frozen=True)
class Plan:
    precision: Precision
    checkpointing: Checkpointing
    optimizer_states: OptimizerStates
    sharding: Sharding
    micro_batching: MicroBatching
    world_size: int = 1
    adapters: Adapters = dataclasses.field(default_factory=Adapters)
    quantization: Quantization = dataclasses.field(default_factory=Quantization)
    loss: Loss = dataclasses.field(default_factory=Loss)
    optimizer_step: OptimizerStep = dataclasses.field(default_factory=OptimizerStep)
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    mesh: MeshShape | None = None  # how the ranks are arranged (None: one data-parallel dimension)
    compile: Compile = dataclasses.field(default_factory=Compile)

    def __post_init__(self) -> None:
        if self.mesh is not None and self.mesh.is_flat:  # one data-parallel dimension: the plan of old
            object.__setattr__(self, "mesh", None)

    @property
    def shape(self) -> MeshShape:
        """The arrangement of the ranks (`memtrain.mesh`)."""
        return self.mesh or MeshShape.flat(self.world_size)

    @property
    def stepped_states(self) -> OptimizerStates:
        """AdamW's state format as this precision steps it: `optimizer_states`, or bf16-true's own
        (`Precision.update_states`); what the trainer builds the optimizer with."""
        return self.precision.update_states(self.optimizer_states, self.optimizer.name)

    @property
    def update_states(self) -> OptimizerStates:
        """What the optimizer keeps, with the facts the memory and step-time models read: the
        `stepped_states` format for AdamW, the optimizer's own states otherwise."""
        return self.optimizer.states(self.stepped_states)

    def strategies(self) -> dict[str, Strategy]:
        return {kind: getattr(self, kind) for kind in REGISTRIES}

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batching.size

    @property
    def accumulation_steps(self) -> int:
        return self.micro_batching.accumulation_steps

    @property
    def micro_batch_tokens(self) -> int | None:
        return self.micro_batching.max_tokens if isinstance(self.micro_batching, TokenBudget) else None

    def replace(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def sharding_backend(self, grad_clip: float | None = None) -> ShardingBackend:
        """The sharding backend this plan trains with."""
        return self.sharding.build(self.precision, self.micro_batch_size, self.accumulation_steps, grad_clip)

    def to_dict(self) -> dict[str, Any]:
        kinds = {kind: s.to_dict() for kind, s in self.strategies().items()}
        mesh = {} if self.mesh is None or self.mesh.is_flat else {"mesh": self.mesh.to_dict()}
        return {**kinds, "world_size": self.world_size, **mesh}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The inverse of `to_dict` (plan.json, checkpoint metadata); `ValueError` for another layout."""
        try:
            kinds = {
                kind: registry.from_dict(data[kind])
                for kind, registry in REGISTRIES.items()
                if kind in data or kind not in (*OPTIONAL_KINDS, *LATER_KINDS)
            }  # plans written before these kinds existed
            mesh = MeshShape.from_dict(data["mesh"]) if "mesh" in data else None
            return cls(**kinds, world_size=int(data["world_size"]), mesh=mesh)
        except (KeyError, TypeError, ValueError, AttributeError, Unsupported) as exc:
            raise ValueError(f"not a memtrain plan ({type(exc).__name__}: {exc})") from None

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line: each strategy with its options, e.g. `bf16-mixed, checkpointing fraction(0.5), states
        fp32, sharding none, micro 4 x 2` (4 sequences per micro-batch, 2 micro-batches per step)."""
        s = self.strategies()
        adapters = "".join(f"{s[k].describe()}, " for k in OPTIONAL_KINDS if s[k].name != "none")
        return adapters + (
            f"{s['precision'].describe()}, checkpointing {s['checkpointing'].describe()}, states "
            f"{s['optimizer_states'].describe()}, sharding {s['sharding'].describe()}, micro "
            f"{s['micro_batching'].describe()}"
            + (f", loss {s['loss'].describe()}" if s["loss"].name != "standard" else "")
            + (f", step {s['optimizer_step'].describe()}" if s["optimizer_step"].name != "standard" else "")
            + (f", optimizer {s['optimizer'].describe()}" if s["optimizer"].name != "adamw" else "")
            + (f", compile {s['compile'].describe()}" if s["compile"].name != "none" else "")
            + (f", mesh {self.mesh.describe()}" if self.mesh is not None and not self.mesh.is_flat else "")
        )

    def summary(self) -> dict[str, Any]:
        """Flat, for tables and `memtrain plan --json` candidates: each kind's `describe()`, and the
        micro-batch size and accumulation steps."""
        return {
            **{kind: s.describe() for kind, s in self.strategies().items()},
            "micro_batch_size": self.micro_batch_size,
            "accumulation_steps": self.accumulation_steps,
        }

    def key(self) -> tuple[Any, ...]:
        """A total order over plans (names, then options), for deterministic ties."""
        return tuple((s.name, repr(s.options())) for s in self.strategies().values())


def is_open(recipe: Recipe) -> bool:
    """Whether the recipe leaves anything for the planner to choose."""
    s = recipe.strategies
    choices = [getattr(s, kind) for kind in RECIPE_KINDS]
    offload = s.sharding_offload
    return (
        recipe.batch.micro_size == "auto"
        and recipe.batch.micro_tokens is None
        or any(not isinstance(c, str) or c == "auto" for c in choices)
        or not isinstance(offload, str)
        or offload == "auto"
        or not isinstance(recipe.optimizer.name, str)
    )


def mesh_of(recipe: Recipe, world_size: int) -> MeshShape:
    """The recipe's mesh (`strategies.mesh`) over `world_size` ranks; `RecipeError` naming the key when the
    degrees cannot arrange them."""
    config = recipe.strategies.mesh
    degrees = {dim: getattr(config, dim) for dim in DIMS}
    try:
        ep = 1 if config.ep == "auto" else config.ep  # an open ep is the mesh search's to choose
        return resolve(degrees, world_size, config.sequence_parallel, config.pp_schedule, ep)
    except ValueError as exc:
        raise RecipeError([str(exc)]) from None


def mesh_problems(mesh: MeshShape, device_type: str) -> list[str]:
    """What this version cannot run of a resolved mesh on `device_type`, one line each naming the key."""
    problems = []
    for other, degree in (
        ("tp", mesh.tp),
        ("pp", mesh.pp),
        ("cp", mesh.cp),
    ):
        if mesh.ep > 1 and degree > 1:
            problems.append(
                f"strategies.mesh.ep: {mesh.ep} expert-parallel ranks with strategies.mesh.{other}={degree} are "
                "not run by this version; set one of them to 1"
            )
    if mesh.cp > 1 and device_type not in RING_ATTENTION_DEVICES:
        problems.append(
            f"strategies.mesh.cp: {mesh.cp} ranks of context parallelism: torch has no context-parallel ring "
            f"for the {device_type.upper()} attention kernels (CUDA only); set it to 1"
        )
    for other, degree in (("tp", mesh.tp), ("pp", mesh.pp)):
        if mesh.cp > 1 and degree > 1:
            problems.append(
                f"strategies.mesh.cp: {mesh.cp} context-parallel ranks with strategies.mesh.{other}={degree} "
                "are not run by this version; set one of them to 1"
            )
    if mesh.pp > 1 and mesh.tp > 1:
        problems.append(
            f"strategies.mesh.pp: {mesh.pp} pipeline stages with tensor parallelism (strategies.mesh.tp="
            f"{mesh.tp}) are not run by this version; set one of them to 1"
        )
    if mesh.pp > 1 and mesh.pp_schedule == "interleaved_1f1b":
        problems.append(
            "strategies.mesh.pp_schedule: interleaved_1f1b needs several stages per rank, which this version "
            "does not split the model into; use 1f1b or gpipe"
        )
    return problems


def arranged(env: DistEnv, recipe: Recipe, chosen: MeshShape | None = None) -> DistEnv:
    """`env` with the recipe's mesh over its ranks (`chosen`: the mesh the planner chose for degrees the
    recipe left open); `RecipeError` naming the key when the degrees cannot arrange them or this version
    cannot run the mesh here (`mesh_problems`)."""
    mesh = chosen or mesh_of(recipe, env.world_size)
    problems = mesh_problems(mesh, env.device.type)
    if problems:
        raise RecipeError(problems)
    if env.is_main and not mesh.is_flat:
        print(f"[memtrain] mesh: {mesh_line(mesh, env.world_size)}", file=sys.stderr, flush=True)
    return env.with_mesh(mesh)


def mesh_line(mesh: MeshShape, world_size: int) -> str:
    """The mesh, and which dimensions cross nodes under this launch (torchrun's LOCAL_WORLD_SIZE ranks per
    node): tensor parallelism across nodes is legal but runs over the slow link."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    crossing = mesh.crossing(per_node)
    where = f"; across nodes: {', '.join(crossing)}" if crossing else "; every dimension within a node"
    warning = " (tp spans nodes: its collectives cross the slow link)" if "tp" in crossing else ""
    return f"{mesh.describe()} over {world_size} ranks, {per_node} per node{where}{warning}"


def per_rank_batch(recipe: Recipe, world_size: int) -> int:
    """Sequences per data-parallel rank per step (`world_size`: the data-parallel ranks); `RecipeError`
    when the global batch does not divide."""
    global_size = recipe.batch.global_size
    if global_size % world_size:
        raise RecipeError(
            [f"batch.global_size: {global_size} is not divisible by the world size {world_size}"]
        )
    micro = recipe.batch.micro_size
    if isinstance(micro, int) and (global_size // world_size) % micro:
        raise RecipeError(
            [
                f"batch.global_size: {global_size} is not divisible by world size x batch.micro_size "
                f"({world_size} x {micro}); change batch.global_size or batch.micro_size"
            ]
        )
    return global_size // world_size


def recipe_strategy(recipe: Recipe, kind: str, name: str) -> Strategy:
    """Strategy `name` of `kind` with its options from the recipe's `strategies:` section."""
    return REGISTRIES[kind].create(name, recipe.strategies.model_dump())


def optimizer_of(recipe: Recipe, name: str) -> Optimizer:
    """Optimizer `name` with its options from the recipe's `optimizer:` section."""
    return OPTIMIZERS.create(name, recipe.optimizer.model_dump())


def micro_batching(recipe: Recipe, rows: int, size: int) -> MicroBatching:
    """`size` rows per micro-batch, or the recipe's token budget over all `rows`."""
    if recipe.batch.micro_tokens is not None:
        return TokenBudget(rows, 1, recipe.batch.micro_tokens)
    return MicroBatching(size, rows // size)


def adapters_of(recipe: Recipe) -> Adapters:
    """The recipe's `adapters:` section as its strategy."""
    options = recipe.adapters.model_dump()
    if isinstance(options.get("target_modules"), list):
        options["target_modules"] = tuple(options["target_modules"])
    return ADAPTERS.create(recipe.adapters.kind, options)


def quantization_of(recipe: Recipe) -> Quantization:
    """The recipe's `model.quantization` as its strategy; base quantisation needs adapters to train."""
    quantization = QUANTIZATION.create(recipe.model.quantization, recipe.model.model_dump())
    if quantization.name != "none" and recipe.adapters.kind == "none":
        raise RecipeError(
            [
                f"model.quantization: {quantization.name} freezes the base model; add adapters "
                "(adapters.kind: lora) so that something trains"
            ]
        )
    return quantization


def pinned_plan(recipe: Recipe, env: DistEnv) -> Plan:
    """The plan of a recipe that pins every choice, each strategy checked on this device."""
    assert not is_open(recipe)
    s = recipe.strategies
    precision = PRECISION.create(str(s.precision), s.model_dump())
    checkpointing = CHECKPOINTING.create(str(s.checkpointing), s.model_dump())
    optimizer_states = OPTIMIZER_STATES.create(str(s.optimizer_states), s.model_dump())
    sharding = SHARDING.create(str(s.sharding), s.model_dump())
    loss = LOSS.create(str(s.loss), s.model_dump())
    optimizer_step = OPTIMIZER_STEP.create(str(s.optimizer_step), s.model_dump())
    compiled = COMPILE.create(str(s.compile), s.model_dump())
    optimizer = optimizer_of(recipe, str(recipe.optimizer.name))
    adapters, quantization = adapters_of(recipe), quantization_of(recipe)
    facts = DeviceFacts.of(env.device, env.world_size, env.mesh)
    for strategy in (
        quantization,
        adapters,
        precision,
        checkpointing,
        loss,
        compiled,
        optimizer_states,
        optimizer,
    ):
        strategy.check(facts)
    compiled.check_with(checkpointing, sharding)
    optimizer.check_with(optimizer_states, sharding, optimizer_step.in_backward)
    precision.update_states(optimizer_states, optimizer.name)  # what bf16-true cannot step is refused
    sharding.check_with(env, precision)
    quantization.check_sharding(sharding)
    loss.check_sharding(sharding)
    rows = per_rank_batch(recipe, env.dp_size)
    size = rows if recipe.batch.micro_size == "auto" else int(recipe.batch.micro_size)
    batching = micro_batching(recipe, rows, size)
    optimizer_step.check_plan(
        batching=batching,
        grad_clip=recipe.train.grad_clip,
        sharding=sharding,
        precision=precision,
    )
    return Plan(
        precision,
        checkpointing,
        optimizer_states,
        sharding,
        batching,
        env.world_size,
        adapters,
        quantization,
        loss,
        optimizer_step,
        optimizer,
        env.mesh,
        compiled,
    )
