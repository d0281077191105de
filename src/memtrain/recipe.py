"""Typed recipes: YAML in, a validated `Recipe` out, with every mistake reported at once.

Why pydantic v2: it collects *all* field errors in one pass and emits a JSON schema for editors
(`memtrain schema`). We add what it lacks: dotted paths, did-you-mean for unknown keys and enum values,
checks that span sections (batch divisibility, sequence length vs the model's maximum), and
`a.b.c=value` command-line overrides applied to the raw mapping before validation.

Input is bounded before anything is built from it (`memtrain.yamlfile`: file size, values with every
YAML alias expanded, nesting depth), and values echoed in messages are cut (`shortened`), so a 5 MB
value makes a short error.

Strategy fields take `auto`, one name, or a list of allowed names (the planner chooses among them).

`Recipe` is what every trainer reads (run, batch, train, checkpoint, output, memory, strategies, adapters,
planner, and `model:` with the base quantisation, which the planner applies to any model). A trainer's own
sections are its own recipe part: a subclass of `Recipe` adding or widening sections (the built-in
causal-LM trainer's `model:` config and `data:` are `memtrain.causal_lm.recipe.CausalLMRecipe`), named by
`Trainer.recipe_class`; the command line resolves `--trainer` before it reads the recipe.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from memtrain.errors import RecipeError, did_you_mean, shortened
from memtrain.jsonfile import mib
from memtrain.loggers import LOGGERS
from memtrain.registry import Registry
from memtrain.schedules import SCHEDULES, DecayShape
from memtrain.strategies.catalog import RECIPE_KINDS, REGISTRIES, chosen_in
from memtrain.yamlfile import MAX_RECIPE_BYTES, cut, parse_yaml, read_yaml

MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*")  # e.g. q_proj, mlp.down_proj, h.0.attn
NAME_MAX, PATH_MAX = 255, 4096  # bytes of one path component, of a whole path (Linux)

StrategyChoice = str | list[str]
"""`auto`, one registered name, or a list of allowed names (checked against the kind's registry)."""


def _registered_name(kind: str, value: str) -> str:
    """`value` when the `kind` registry has it, else the error naming the registered names."""
    registry = REGISTRIES[kind]
    if value not in registry:
        raise PydanticCustomError(
            "registered_name",
            "{word} is not one of {listed}{hint}",
            {
                "word": shortened(value),
                "listed": ", ".join(registry.names()),
                "hint": did_you_mean(value, registry.names()),
            },
        )
    return value


class RecipeSection(BaseModel):
    """One section of a recipe: unknown keys, inf and nan are refused (YAML reads .inf and .nan as floats).
    A trainer's own sections derive from it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RunConfig(RecipeSection):
    name: str = "run"
    output_dir: str | None = Field(default=None, description="Run directory; default runs/<name>.")
    seed: int = Field(default=0, ge=0, lt=2**32, description="0 <= seed < 2**32 (numpy's range).")


class ModelSection(RecipeSection):
    """`model:` — the base quantisation (`model.quantization` and its options, generated from the
    quantization registry into `ModelConfig`). A trainer's recipe part widens it with how its model is
    built (the built-in trainer: `config`, `config_path`, `pretrained`, `attn_implementation`)."""

    if TYPE_CHECKING:  # the generated strategy keys

        def __getattr__(self, name: str) -> Any: ...

    @field_validator("quantization", check_fields=False)
    @classmethod
    def _registered(cls, value: str) -> str:
        return _registered_name("quantization", value)


class BatchConfig(RecipeSection):
    global_size: int = Field(default=16, gt=0, description="Sequences per optimizer step over all ranks.")
    micro_size: int | Literal["auto"] = Field(
        default="auto", description="Sequences per micro-batch per rank."
    )
    micro_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Token budget per micro-batch (rows x longest row), instead of micro_size: for variable-length data.",
    )

    @field_validator("micro_size")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value <= 0:
            raise ValueError("must be a positive integer or 'auto'")
        return value


def _names_in_schema(registry: Registry[Any], items: bool = False) -> Callable[[JsonDict], None]:
    """A `json_schema_extra` listing the registry's names as the schema is made (a name registered after
    this module was imported is listed too); `items`: for a list of names."""

    def extra(schema: JsonDict) -> None:
        target = schema["items"] if items else schema
        assert isinstance(target, dict)
        target["enum"] = list(registry.names())

    return extra


def _registered_in(registry: Registry[Any], value: str) -> str:
    """`value` when `registry` has it, else the error naming its names (one line under the key)."""
    if value not in registry:
        raise PydanticCustomError("registered_name", "{problem}", {"problem": registry.unknown(value)})
    return value


# Signals that may ask a run to stop like a pre-emption (memtrain.training.preemption): requests, not
# crash reports (SIGSEGV, SIGABRT) or notices (SIGCHLD), and not SIGKILL or SIGSTOP, which no process can
# catch. SIGINT is Ctrl-C, always handled. SIGUSR2, SIGXCPU, SIGALRM, SIGPWR: other schedulers' warnings.
StopSignal = Literal["SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU", "SIGALRM", "SIGPWR"]
DEFAULT_STOP_SIGNALS: tuple[StopSignal, ...] = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGQUIT")


MAX_LR = 1e3
"""The largest `train.lr`. AdamW moves each weight by about lr every step (its normalised update
m/(sqrt(v) + eps) is +-1 on step 1 for any nonzero gradient), and trained weights are O(1): an lr above
1000 is a typo, never a setting. Past ~3.4e37 (lr / (1 - beta1) beyond fp32's 3.4e38) torch cannot even
represent the step size and raises inside `optimizer.step()`, after the first step's work."""


class EarlyStoppingConfig(RecipeSection):
    patience: int = Field(
        gt=0, description="Evaluations in a row without an improvement before the run stops (checkpointed)."
    )
    min_delta: float = Field(
        default=0.0, ge=0.0, description="An eval loss this much below the best so far is an improvement."
    )


class TrainConfig(RecipeSection):
    steps: int = Field(default=100, gt=0)
    lr: float = Field(default=3e-4, gt=0, description=f"Peak learning rate, at most {MAX_LR:g}.")
    schedule: str = Field(
        default="cosine",
        description="Learning-rate schedule after the linear warmup (memtrain.schedules): cosine or linear decay "
        "to min_lr_ratio * lr at train.steps, constant, or wsd (constant, then train.decay_shape over the last "
        "train.decay_fraction of the steps).",
        json_schema_extra=_names_in_schema(SCHEDULES),
    )
    min_lr_ratio: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="The learning rate decays to min_lr_ratio * lr at train.steps.",
    )
    decay_fraction: float = Field(
        default=0.2, gt=0.0, le=1.0, description="schedule wsd: the share of train.steps its decay takes."
    )
    decay_shape: DecayShape = Field(
        default="linear", description="schedule wsd: how its decay falls to min_lr_ratio * lr."
    )
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    eval_every: int = Field(default=0, ge=0, description="0 disables evaluation.")
    eval_batches: int = Field(default=4, gt=0)
    early_stopping: EarlyStoppingConfig | None = Field(
        default=None,
        description="Stop when the eval loss has not improved for `patience` evaluations (needs "
        "train.eval_every), e.g. {patience: 3, min_delta: 0.01}.",
    )
    log_every: int = Field(default=1, gt=0)
    max_bad_steps: int = Field(
        default=5,
        gt=0,
        description="Consecutive steps with non-finite gradients (each skipped) before the run stops.",
    )
    stop_signals: list[StopSignal] = Field(
        default_factory=lambda: list(DEFAULT_STOP_SIGNALS),
        description="Signals that stop the run like a pre-emption: the step in flight finishes, a "
        "checkpoint is written, exit 0, and --resume continues. SIGINT (Ctrl-C) is always handled the same "
        "way but exits 130.",
    )

    @field_validator("schedule")
    @classmethod
    def _registered_schedule(cls, value: str) -> str:
        return _registered_in(SCHEDULES, value)

    @field_validator("lr")
    @classmethod
    def _lr_bounded(cls, value: float) -> float:
        if value > MAX_LR:
            raise PydanticCustomError(
                "lr_bound",
                "above {limit}: AdamW moves every weight by about lr per step (a typo? 1e-4 to 1e-2 is usual)",
                {"limit": f"{MAX_LR:g}"},
            )
        return value

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class CheckpointConfig(RecipeSection):
    every: int = Field(default=0, ge=0, description="Save every N steps (0: only at the end).")
    keep: int = Field(default=2, gt=0)
    at_end: bool = True
    fallback: bool = Field(
        default=False,
        description="On resume, fall back to the previous checkpoint when the newest is unreadable.",
    )


class MemoryConfig(RecipeSection):
    budget: ByteSize | None = Field(
        default=None,
        gt=0,
        description="Simulated device budget (e.g. 1.5GiB): a real torch.OutOfMemoryError is raised the "
        "moment tracked live bytes would pass it. Implies track.",
    )
    track: bool = Field(default=False, description="Run the full memory tracker (slower) and log its report.")


class OutputConfig(RecipeSection):
    progress: Literal["auto", "on", "off"] = "auto"
    loggers: list[str] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where each step's metrics go (memtrain.loggers; jsonl: metrics.jsonl in the run directory).",
        json_schema_extra=_names_in_schema(LOGGERS, items=True),
    )
    log_every_s: float = Field(
        default=30.0,
        ge=0.0,
        description="A plain progress line this often when stderr is not a terminal (0: never).",
    )
    export: Literal["none", "hf"] = Field(
        default="none",
        description="hf: write a Hugging Face model directory (run_dir/hf) at the end of the run.",
    )

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: object) -> object:
        # YAML 1.1 reads a bare on/off as true/false.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("loggers")
    @classmethod
    def _registered_loggers(cls, value: list[str]) -> list[str]:
        return [_registered_in(LOGGERS, name) for name in value]


Degree = int | Literal["auto"]


class MeshConfig(RecipeSection):
    """`strategies.mesh:` — the degree of each kind of parallelism (`memtrain.mesh`); their product is the
    world size. The default is 1-D data parallelism over every rank."""

    dp_replicate: Degree = Field(default=1, description="HSDP replicas (outer, between nodes); zero2/zero3.")
    dp_shard: Degree = Field(default="auto", description="Data-parallel shard group (FSDP); auto: the rest.")
    tp: Degree = Field(default=1, description="Tensor-parallel degree (innermost: within a node).")
    pp: Degree = Field(default=1, description="Pipeline stages (outermost).")
    cp: Degree = Field(default=1, description="Context-parallel degree (CUDA only).")
    ep: Degree = Field(
        default=1, description="Expert-parallel degree: splits each MoE layer's experts within dp_shard."
    )
    sequence_parallel: bool = Field(
        default=True, description="Under tp > 1, also shard norms and dropout along the sequence."
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        default="1f1b", description="Under pp > 1, the order stages run micro-batches in (torch's schedules)."
    )

    @field_validator("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
    @classmethod
    def _positive(cls, value: Degree) -> Degree:
        if isinstance(value, int) and value < 1:
            raise PydanticCustomError("degree", "a degree is at least 1 (or auto)")
        return value


# The busiest expert-parallel rank's routed rows over the mean, assumed when the recipe says nothing. Why 1.5:
# capacity factors are sized to cover routing imbalance with load-balancing losses on (Switch Transformer
# trains at 1.25, GShard at 2.0, per expert); a rank's load sums E/ep experts, less skewed than one expert's,
# and DeepSeek-V3-style balancing reports a maximal violation (max / mean - 1) under 0.5 once training settles.
DEFAULT_MAX_LOAD = 1.5


class MoeConfig(RecipeSection):
    """`strategies.moe:` — how mixture-of-experts layers route, for the planner's per-rank memory under
    expert parallelism (`strategies.mesh.ep`; planner/expert_parallel.py)."""

    max_load: float = Field(
        default=DEFAULT_MAX_LOAD,
        ge=1.0,
        description="Bound on the busiest expert-parallel rank's routed rows over the mean (1 = balanced).",
    )
    capacity_factor: float | None = Field(
        default=None,
        gt=0.0,
        description="Experts drop rows over capacity_factor x their fair share (None: dropless, as the "
        "built-in trainer routes).",
    )


class _StrategiesSection(RecipeSection):
    """`strategies:` — each strategy kind takes `auto`, a name from its registry
    (`memtrain.strategies.catalog`), or a list of allowed names; the other keys are the strategies'
    options. Every key is generated from the registries' declarations into `StrategiesConfig`."""

    mesh: MeshConfig = MeshConfig()
    moe: MoeConfig = MoeConfig()

    if TYPE_CHECKING:  # the generated keys

        def __getattr__(self, name: str) -> Any: ...

    @field_validator(*RECIPE_KINDS, check_fields=False)
    @classmethod
    def _registered(cls, value: StrategyChoice, info: ValidationInfo) -> StrategyChoice:
        registry = REGISTRIES[str(info.field_name)]
        names = [value] if isinstance(value, str) else value
        if not names:
            raise PydanticCustomError("registered_name", "an empty list allows nothing; give a name or auto")
        for name in names:
            if name in registry or (name == "auto" and isinstance(value, str)):
                continue
            listed = ", ".join((*registry.names(), "auto"))
            raise PydanticCustomError(
                "registered_name",
                "{word} is not one of {listed} (or a list of them){hint}",
                {"word": shortened(name), "listed": listed, "hint": did_you_mean(name, registry.names())},
            )
        return value

    @field_validator("sharding_offload", check_fields=False)
    @classmethod
    def _some_offload(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise PydanticCustomError(
                "offload_choice", "an empty list allows nothing; give none, a value or auto"
            )
        return value


class _OptimizerSection(RecipeSection):
    """`optimizer:` — which optimizer trains (`name`: one registered name, or a list the planner chooses
    among; never `auto`, since the optimizer changes the training) and its options, generated from the
    optimizer registry into `OptimizerConfig`. Its hyper-parameters stay under `train:` (lr, betas, eps,
    weight_decay)."""

    if TYPE_CHECKING:  # the generated keys

        def __getattr__(self, name: str) -> Any: ...

    @field_validator("name", check_fields=False)
    @classmethod
    def _registered(cls, value: StrategyChoice) -> StrategyChoice:
        names = [value] if isinstance(value, str) else value
        if not names:
            raise PydanticCustomError("registered_name", "an empty list allows nothing; give a name")
        if "auto" in names:
            raise PydanticCustomError(
                "registered_name",
                "auto would let the planner change the training; list the optimizers it may choose "
                "among (e.g. [adamw, adafactor])",
            )
        for name in names:
            _registered_name("optimizer", name)
        return value


class _AdaptersSection(RecipeSection):
    """`adapters:` — parameter-efficient fine-tuning: adapters on a frozen base (the planner plans within
    them). `kind` and its options are generated from the adapters registry into `AdaptersConfig`."""

    if TYPE_CHECKING:  # the generated keys

        def __getattr__(self, name: str) -> Any: ...

    @field_validator("kind", check_fields=False)
    @classmethod
    def _registered(cls, value: str) -> str:
        return _registered_name("adapters", value)

    @field_validator("target_modules", check_fields=False)
    @classmethod
    def _module_names(cls, value: list[str] | str) -> list[str] | str:
        """Each entry is a module name (suffix) as PyTorch spells them: peft silently ignores a name that
        matches nothing when another one matches, so a typo, a look-alike letter or `all-linear` inside
        a list would train without the adapters the user asked for."""
        if value == ["all-linear"]:
            return "all-linear"
        for name in [] if isinstance(value, str) else value:
            if name == "all-linear" and len(value) > 1:
                raise PydanticCustomError(
                    "module_name", "all-linear stands alone (target_modules: all-linear), not in a list"
                )
            if not MODULE_NAME.fullmatch(name) and name != "all-linear":
                raise PydanticCustomError(
                    "module_name",
                    "{word} is not a module name (ASCII letters, digits, '_' and '.'){hint}",
                    {"word": shortened(name), "hint": did_you_mean(name, ["all-linear"])},
                )
        return value


class PlannerConfig(RecipeSection):
    safety_fraction: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Share of the free memory kept back for what no prediction sees (other processes, the "
        "driver's growth during the run; default 0.02). Prediction error is planner.reserved_margin's, "
        "the allocator's slack its replay's.",
    )
    reserved_margin: float | None = Field(
        default=None,
        ge=0.0,
        lt=1.0,
        description="Share added to a plan's predicted reserved bytes (the CUDA caching allocator's segments, "
        "replayed over the traced step) before they are held to the usable memory, for prediction error; "
        "CUDA targets only (default: the largest under-prediction measured against published GPU runs, "
        "at least 2%: planner/prediction_error.json, written by scripts/bench_published.py).",
    )
    measure_links: bool = Field(
        default=True,
        description="On several ranks, time a few collectives per mesh dimension at the start of the run and "
        "cache the fitted links ($MEMTRAIN_CACHE_DIR/links.json; off there: never), so the mesh search for "
        "this machine ranks with them instead of the default NVLink and InfiniBand figures.",
    )
    checkpointing_fractions: list[float] = Field(
        default=[0.25, 0.5, 0.75],
        min_length=1,
        description="Fractions of blocks the planner tries when strategies.checkpointing is auto or a list "
        "(a pinned checkpointing=fraction uses strategies.checkpointing_fraction).",
    )

    @field_validator("checkpointing_fractions")
    @classmethod
    def _in_range(cls, value: list[float]) -> list[float]:
        if any(not 0.0 < f <= 1.0 for f in value):
            raise ValueError("every fraction must be in (0, 1]")
        return value


def strategy_keys_section(name: str, base: type[RecipeSection], section: str) -> Any:
    """`base` with a field per strategy key read from `section`: each kind's choice and every option,
    as the registries declare them (`memtrain.strategies.registry.option`); nothing here repeats one.
    A registry that changes later regenerates it in every recipe class (`_refresh_strategy_keys`)."""
    fields: dict[str, Any] = {}
    for registry in chosen_in(section):
        kind = registry.recipe
        assert kind is not None  # chosen_in lists registries a recipe chooses
        choice = StrategyChoice if kind.planner_choice else str
        fields[kind.key] = (choice, Field(default=kind.default, description=kind.doc))
        for spec in registry.options():
            fields[spec.key] = (
                spec.annotation,
                Field(default=spec.default, description=spec.doc, **spec.bounds),
            )
    generated = create_model(name, __base__=base, __module__=base.__module__, **fields)
    _GENERATED[generated] = (name, base, section)
    return generated


_GENERATED: dict[type, tuple[str, type[RecipeSection], str]] = {}
"""Each section class `strategy_keys_section` made -> what it was made from (to make it again)."""

if TYPE_CHECKING:
    ModelConfig = ModelSection
    StrategiesConfig = _StrategiesSection
    AdaptersConfig = _AdaptersSection
    OptimizerConfig = _OptimizerSection
else:
    ModelConfig = strategy_keys_section("ModelConfig", ModelSection, "model")
    StrategiesConfig = strategy_keys_section("StrategiesConfig", _StrategiesSection, "strategies")
    AdaptersConfig = strategy_keys_section("AdaptersConfig", _AdaptersSection, "adapters")
    OptimizerConfig = strategy_keys_section("OptimizerConfig", _OptimizerSection, "optimizer")

LaterChecks = Callable[["Recipe", set[str]], list[str]]
R = TypeVar("R", bound="Recipe")


class Recipe(RecipeSection):
    """The sections every trainer reads. A trainer's own recipe part subclasses it: new sections as
    fields, a widened `model:` section (from `strategy_keys_section`), its path keys and cross checks."""

    path_keys: ClassVar[tuple[str, ...]] = ("run.output_dir", "strategies.deepspeed_config")
    """Keys that name a file or directory (checked as paths before any is opened)."""
    sequence_length_key: ClassVar[str | None] = None
    """The key that sets the training sequence length, when the recipe has one (a memory tip names it)."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    batch: BatchConfig = BatchConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    output: OutputConfig = OutputConfig()
    memory: MemoryConfig = MemoryConfig()
    strategies: StrategiesConfig = StrategiesConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    planner: PlannerConfig = PlannerConfig()

    def output_path(self) -> Path:
        return Path(self.run.output_dir or f"runs/{self.run.name}")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def fingerprint(self) -> str:
        """Hash of the resolved recipe; stored with checkpoints to detect resuming a different run."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def path_values(self) -> dict[str, Any]:
        """The value of each key that names a file or directory (`path_keys`; a recipe part may add keys
        of its own that a dotted name cannot reach, such as a list's entries)."""
        return {key: self.value_at(key) for key in self.path_keys}

    def value_at(self, dotted: str) -> Any:
        """The value of a dotted key (`data.seq_len`)."""
        value: Any = self
        for part in dotted.split("."):
            value = getattr(value, part)
        return value

    def cross_checks(self) -> list[str]:
        """Checks that span sections, one line per problem naming its key; a recipe part adds its own
        (after `super().cross_checks()`)."""
        problems = []
        micro = self.batch.micro_size
        if self.batch.micro_tokens is not None and micro != "auto":
            problems.append(
                "batch.micro_tokens: give either batch.micro_tokens or batch.micro_size, not both"
            )
        if isinstance(micro, int) and micro > self.batch.global_size:
            problems.append(f"batch.micro_size: {micro} exceeds batch.global_size ({self.batch.global_size})")
        if self.train.early_stopping is not None and not self.train.eval_every:
            problems.append("train.early_stopping: stops on the eval loss; set train.eval_every above 0")
        if self.train.lr * self.train.weight_decay > 1:
            problems.append(
                f"train.weight_decay: {self.train.weight_decay:g} times train.lr ({self.train.lr:g}) is above 1; "
                "AdamW multiplies every weight by 1 - lr * weight_decay each step (0.01 to 0.1 is usual)"
            )
        return problems + _path_problems(self)

    @classmethod
    def load(
        cls: type[R],
        path: str | Path,
        overrides: list[str] | None = None,
        later_checks: LaterChecks | None = None,
    ) -> R:
        """Read, override and validate a recipe file; raise `RecipeError` listing every problem.

        When the schema finds problems, `later_checks(recipe, failed_sections)` (the model config, the
        data, the output directory, a DeepSpeed config: `memtrain.commands.trainers.load_checked_recipe`
        passes them) runs on the sections that did validate, so one pass reports every mistake. It is
        passed in, not imported, because those checks build on the recipe (the import arrow points the
        other way)."""
        source = str(path)
        try:
            raw = read_yaml(Path(path))
            raw = apply_overrides(raw, overrides or [], source)
            recipe, problems = _validate(cls, raw)
            if problems and recipe is not None and later_checks is not None:
                problems += later_checks(recipe, _sections(problems))
        except RecursionError:  # the YAML parser, copying and validation all recurse per level
            raise RecipeError(
                ["the recipe is nested too deeply (hundreds of levels) to be a recipe"], source
            ) from None
        if problems or recipe is None:
            raise RecipeError(problems, source)
        return recipe

    @classmethod
    def adopt(cls: type[R], recipe: Recipe) -> R:
        """`recipe` as a `cls`: itself when it is one, else its keys validated again as one (a recipe part's
        own sections then stand at their defaults)."""
        return recipe if isinstance(recipe, cls) else cls.from_dict(recipe.to_dict())

    @classmethod
    def from_dict(cls: type[R], raw: dict[str, Any], source: str = "recipe") -> R:
        """Validate a raw mapping (paths inside it are relative to the working directory, as with torchrun)."""
        recipe, problems = _validate(cls, raw)
        if problems or recipe is None:
            raise RecipeError(problems, source=source)
        return recipe

    @classmethod
    def editor_schema(cls) -> dict[str, Any]:
        """JSON schema for editors (`memtrain schema`), the registered names listed where a key takes one."""
        schema = cls.model_json_schema()
        schema["title"] = "memtrain recipe"
        defs = schema["$defs"]
        strategies = defs["StrategiesConfig"]["properties"]
        for kind in RECIPE_KINDS:  # the names come from the registries: the schema lists what is registered
            names = ["auto", *REGISTRIES[kind].names()]
            strategies[kind] = {
                "default": strategies[kind].get("default"),
                "anyOf": [{"enum": names}, {"type": "array", "items": {"enum": names[1:]}}],
            }
        defs["AdaptersConfig"]["properties"]["kind"]["enum"] = list(REGISTRIES["adapters"].names())
        model = cls.model_fields["model"].annotation
        assert isinstance(model, type)
        defs[model.__name__]["properties"]["quantization"]["enum"] = list(REGISTRIES["quantization"].names())
        return schema


def _recipe_classes() -> list[type[Recipe]]:
    """`Recipe` and every recipe part defined so far, parents first."""
    found: list[type[Recipe]] = []
    todo = [Recipe]
    while todo:
        cls = todo.pop(0)
        found.append(cls)
        todo += cls.__subclasses__()
    return found


def _refresh_strategy_keys() -> None:
    """Regenerate the sections' strategy keys after a registry changed: a strategy registered after this
    module was imported (a user's, with options of its own) is a recipe key like the built-in ones, in
    every recipe class."""
    renewed: dict[type, type] = {}
    for recipe_class in _recipe_classes():
        for field in recipe_class.model_fields.values():
            old = field.annotation
            if not isinstance(old, type) or old not in _GENERATED or old in renewed.values():
                continue
            if old not in renewed:
                renewed[old] = strategy_keys_section(*_GENERATED[old])
            field.annotation, field.default = renewed[old], renewed[old]()
        recipe_class.model_rebuild(force=True)
    for old in renewed:
        del _GENERATED[old]


for _registry in REGISTRIES.values():
    _registry.watch(_refresh_strategy_keys)


# ----------------------------------------------------------------------------------------- loading


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "recipe") -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (values parsed as YAML, bounded as a recipe is) to a copy of the raw
    mapping."""
    result = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"override {shortened(item)}: expected key.path=value, e.g. train.steps=20")
            continue
        if len(text) > MAX_RECIPE_BYTES:
            problems.append(
                f"override {cut(key.strip(), 80)}: the value is {len(text):,} characters, over the limit of "
                f"{mib(MAX_RECIPE_BYTES)} for a recipe"
            )
            continue
        try:
            value = parse_yaml(text, source, key.strip()) if text.strip() else None
        except yaml.YAMLError:
            value = text
        except RecipeError as exc:
            problems += [f"override {line}" for line in exc.problems]
            continue
        node = result
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                problems.append(f"override {shortened(item)}: {cut(part, 80)} is not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    if problems:
        raise RecipeError(problems, source=source)
    return result


def _validate(schema: type[R], raw: dict[str, Any]) -> tuple[R | None, list[str]]:
    """(the recipe, its problems). With problems, the recipe has every section that has one at its
    defaults (None when even that does not validate), for the checks that run on what is valid."""
    try:
        recipe: R | None = schema.model_validate(raw)
        problems: list[str] = []
    except ValidationError as exc:
        problems = _describe(schema, exc)
        invalid = _sections(problems)
        valid = {k: v for k, v in raw.items() if k in schema.model_fields and k not in invalid}
        try:
            recipe = schema.model_validate(valid)
        except ValidationError:
            recipe = None
    if recipe is not None:
        problems += recipe.cross_checks()
    return recipe, problems


def _sections(problems: list[str]) -> set[str]:
    """The top-level recipe keys that problem lines name (each line starts with its dotted key)."""
    return {re.split(r"[.: ]", line, maxsplit=1)[0] for line in problems}


def _describe(schema: type[Recipe], exc: ValidationError) -> list[str]:
    """One line per recipe key: dotted path, what is wrong, and a did-you-mean where it helps.

    pydantic reports a union field (e.g. `auto | name | [names]`) once per branch; those are grouped
    under the field's own path so the user sees one message per key.
    """
    grouped: dict[str, list[Any]] = {}
    for err in exc.errors():
        path = ".".join(_field_path(schema, [str(p) for p in err["loc"]]))
        grouped.setdefault(path, []).append(err)
    problems = []
    for path, errors in grouped.items():
        loc = path.split(".")
        first = errors[0]
        if first["type"] == "extra_forbidden":
            parent = _model_at(schema, loc[:-1])
            hint = did_you_mean(loc[-1], parent.model_fields) if parent else ""
            problems.append(f"{cut(path, 120)}: unknown key{hint}")
            continue
        if first["type"] == "registered_name":
            problems.append(f"{path}: {first['msg']}")
            continue
        allowed = _allowed_at(schema, loc)
        bad_words = [e.get("input") for e in errors if e["type"] == "literal_error"]
        bad_words = [w for w in bad_words if isinstance(w, str) and w not in allowed]
        if allowed and bad_words:
            word = bad_words[-1]
            listed = ", ".join(allowed)
            if any(e["type"].startswith("int_") for e in errors):
                listed = "a positive integer, " + listed
            takes_list = any("list" in str(p) for e in errors for p in e["loc"])
            suffix = " (or a list of them)" if takes_list else ""
            problems.append(
                f"{path}: {shortened(word)} is not one of {listed}{suffix}{did_you_mean(word, allowed)}"
            )
        else:
            problems.append(f"{path}: {first['msg']} (got {shortened(first.get('input'))})")
    return problems


def _field_path(schema: type[Recipe], loc: list[str]) -> list[str]:
    """The leading part of a pydantic error location that names recipe keys (drops union branch tags); an
    entry of a list of sections is named by its index (`data.mixture[1].weight`)."""
    model: type[BaseModel] | None = schema
    items: type[BaseModel] | None = None  # the last key holds a list of these sections
    path: list[str] = []
    for part in loc:
        if items is not None and part.isdigit():
            path[-1] += f"[{part}]"
            model, items = items, None
            continue
        if model is None:
            break
        path.append(part)
        field = model.model_fields.get(part)
        if field is None:
            break
        model, items = _section(field.annotation), _section(field.annotation, items=True)
    return path


def _section(annotation: Any, items: bool = False) -> type[BaseModel] | None:
    """The section class `annotation` is (`items`: holds a list of, maybe optional), or None."""
    if items:
        lists = [a for a in (annotation, *get_args(annotation)) if get_origin(a) is list]
        annotation = get_args(lists[0])[0] if lists else None
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _model_at(schema: type[Recipe], loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] = schema
    for part in loc:
        name, indexed, _ = part.partition("[")
        field = model.model_fields.get(name)
        section = _section(field.annotation, items=bool(indexed)) if field else None
        if section is None:
            return None
        model = section
    return model


def _allowed_at(schema: type[Recipe], loc: list[str]) -> list[str]:
    parent = _model_at(schema, loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent else None
    if field is None:
        return []
    return _literal_values(field.annotation)


def _literal_values(annotation: Any) -> list[str]:
    values: list[str] = []
    for arg in get_args(annotation) or ():
        if isinstance(arg, str):
            values.append(arg)
        else:
            values.extend(v for v in _literal_values(arg) if v not in values)
    return values


def _path_problems(recipe: Recipe) -> list[str]:
    """Path values the filesystem would refuse with an exception (a NUL byte, a name too long, text that
    is not Unicode), each a problem naming its key; `run.name` is a path component without run.output_dir."""
    given = recipe.path_values()
    if recipe.run.output_dir is None:
        given["run.name"] = recipe.run.name
    problems = []
    for key, value in given.items():
        problem = _path_problem(value) if isinstance(value, str) else None
        if problem is not None:
            problems.append(f"{key}: {problem} (got {shortened(value)})")
    name = recipe.run.name
    if recipe.run.output_dir is None and ("/" in name or name in ("", ".", "..")):
        problems.append(  # `..` or `../../x` put the run outside runs/
            f"run.name: {shortened(name)} must be one folder name under runs/ (no '/', not '.' or '..'); set "
            "run.output_dir for a run directory elsewhere"
        )
    return problems


def _path_problem(value: str) -> str | None:
    try:
        encoded = os.fsencode(value)
    except UnicodeError:
        return "not valid Unicode (a lone surrogate) in a path"
    if b"\0" in encoded:
        return "a path cannot hold a NUL character"
    if len(encoded) > PATH_MAX:
        return f"a path of {len(encoded):,} bytes, over the {PATH_MAX} a path may have"
    if any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        return f"a path with a name over the {NAME_MAX} bytes a file name may have"
    return None
