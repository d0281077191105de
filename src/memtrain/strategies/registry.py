"""The `Strategy` base and one name -> class registry per kind: the only vocabulary of strategy names.

Why a registry: the recipe schema, the CLI help, the planner's grid and the docs all need the list of
names a kind has, and every place that turns a name into behaviour needs the class. Both come from here,
so a new strategy is one file (a frozen dataclass subclassing its kind's base) plus one registry line
(`CHECKPOINTING.register(MyMode)`, or the decorator form); nothing else changes.

A strategy is a small frozen dataclass. Its class attribute `name` is what a recipe types; its fields
are its recipe options, each declared once with `option(...)`: default, type, bounds, a line of
documentation and whether changing it mid-run changes the training (`changes_trajectory`). Each is read
from the flat key of the kind's recipe section named by `recipe_key` (default `<kind>_<field>`, e.g.
`strategies.checkpointing_fraction`), so the YAML stays flat. From these declarations (and the kind's own
`RecipeKey` on its registry) come the recipe schema (`memtrain.recipe`), the keys a resume may change
freely (`memtrain.run.lineage`) and the options table of docs/STRATEGIES.md (`catalog.options_table`);
`tests/test_architecture.py` fails when any of them is written by hand.

Every strategy has `check(facts)`, which raises `Unsupported` naming the key to change when it cannot run
on a device, and `to_dict()` / `Registry.from_dict()` for plan.json and checkpoint metadata.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from memtrain.errors import Unsupported, did_you_mean
from memtrain.mesh import MeshShape


@dataclass(frozen=True)
class DeviceFacts:
    """What a strategy's `check` may ask about where the plan runs: a real device, or one described by a
    what-if (`memtrain plan --gpu ...`), whose capabilities come from its profile instead of CUDA."""

    device_type: str
    world_size: int = 1
    bf16: bool = True
    fp8: bool = False
    what_if: bool = False
    mesh: MeshShape | None = None  # how the ranks are arranged (None: one data-parallel dimension)

    @property
    def shape(self) -> MeshShape:
        return self.mesh or MeshShape.flat(self.world_size)

    @classmethod
    def of(cls, device: torch.device, world_size: int = 1, mesh: MeshShape | None = None) -> DeviceFacts:
        """The facts of a device present in this process."""
        if device.type != "cuda":
            return cls(device.type, world_size, bf16=True, fp8=False, mesh=mesh)
        capability = torch.cuda.get_device_capability(device)
        bf16 = torch.cuda.is_bf16_supported()
        return cls("cuda", world_size, bf16=bf16, fp8=capability >= (8, 9), mesh=mesh)


@dataclass(frozen=True)
class Strategy:
    """Base of every strategy: `name` (class attribute) and recipe options (dataclass fields)."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def check(self, facts: DeviceFacts) -> None:
        """Raise `Unsupported` (naming the recipe key to change) when this cannot run on `facts`."""

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options()}

    def describe(self) -> str:
        """The name with the options that differ from their defaults, e.g. `fraction(0.5)`."""
        changed = [str(v) for f in dataclasses.fields(self) if (v := getattr(self, f.name)) != f.default]
        return f"{self.name}({', '.join(changed)})" if changed else self.name


S = TypeVar("S", bound=Strategy)


@dataclass(frozen=True)
class RecipeKey:
    """Where a kind is chosen in a recipe: `section.key` (e.g. `strategies.precision`, `adapters.kind`,
    `model.quantization`), its default name, whether a list of names (and `auto`) may leave the choice to
    the planner, and whether switching it on a resume changes the training."""

    section: str
    key: str
    default: str
    doc: str
    changes_trajectory: bool
    planner_choice: bool = True


@dataclass(frozen=True)
class OptionSpec:
    """One strategy option as the recipe sees it (see `option`)."""

    section: str
    key: str
    default: Any
    annotation: Any  # the type a recipe gives (the field's own unless `recipe_type` says otherwise)
    doc: str
    changes_trajectory: bool
    bounds: Mapping[str, Any] = field(default_factory=dict)  # pydantic's gt / ge / lt / le

    @property
    def path(self) -> str:
        return f"{self.section}.{self.key}"


class Registry(Generic[S]):
    """Names of one kind, in registration order, and the class behind each; `recipe` says where a recipe
    chooses the kind (None: the plan derives it, like micro-batching from `batch:`)."""

    def __init__(self, kind: str, base: type[S], recipe: RecipeKey | None = None) -> None:
        self.kind = kind
        self.base = base
        self.recipe = recipe
        self._classes: dict[str, type[S]] = {}
        self._watchers: list[Callable[[], None]] = []

    def watch(self, changed: Callable[[], None]) -> None:
        """Call `changed` after every later registration or removal (the recipe regenerates its keys)."""
        self._watchers.append(changed)

    def register(self, cls: type[S]) -> type[S]:
        """Add a strategy class (usable as a decorator). Its `name` must be new to this kind."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__}")
        if not cls.name or cls.name == "auto" or cls.name in self._classes:
            raise ValueError(f"strategies.{self.kind}: name {cls.name!r} is empty, reserved or taken")
        if self.recipe is not None:
            self._option_specs(cls)  # every field is a declared option (raises naming the one that is not)
        self._classes[cls.name] = cls
        self._changed()
        return cls

    def unregister(self, name: str) -> None:
        """Remove a name (tests that register a toy strategy clean up with this)."""
        if self._classes.pop(name, None) is not None:
            self._changed()

    def _changed(self) -> None:
        for changed in self._watchers:
            changed()

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def __iter__(self) -> Iterator[type[S]]:
        return iter(tuple(self._classes.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def get(self, name: str) -> type[S]:
        cls = self._classes.get(name)
        if cls is None:
            raise Unsupported(
                f"strategies.{self.kind}: {name!r} is not one of {', '.join(self._classes)}"
                f"{did_you_mean(name, self._classes)}"
            )
        return cls

    def option_key(self, f: dataclasses.Field[Any]) -> str:
        """The recipe key (within the kind's section) a field is read from."""
        return str(f.metadata.get("recipe_key") or f"{self.kind}_{f.name}")

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> S:
        """The strategy `name` with its options read from the flat mapping of the kind's recipe section."""
        cls = self.get(name)
        given = options or {}
        values = {}
        for f in dataclasses.fields(cls):
            key = self.option_key(f)
            if key in given:
                values[f.name] = given[key]
        return cls(**values)

    def from_dict(self, data: Mapping[str, Any]) -> S:
        """The inverse of `Strategy.to_dict` (plan.json, checkpoint metadata)."""
        cls = self.get(str(data.get("name")))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def options(self) -> list[OptionSpec]:
        """Every option of every registered class, once (classes sharing a field share its declaration)."""
        found: dict[str, OptionSpec] = {}
        for cls in self:
            for spec in self._option_specs(cls):
                if found.setdefault(spec.key, spec) != spec:
                    raise TypeError(f"{self.kind}: option {spec.key!r} is declared twice, differently")
        return list(found.values())

    def _option_specs(self, cls: type[S]) -> list[OptionSpec]:
        assert self.recipe is not None
        hints = typing.get_type_hints(cls)
        specs = []
        for f in dataclasses.fields(cls):
            declared = f.metadata.get("option")
            if not isinstance(declared, _Declared):
                raise TypeError(
                    f"{cls.__name__}.{f.name}: a {self.kind} strategy's field is a recipe option; declare it "
                    "with memtrain.strategies.registry.option(default, doc=..., changes_trajectory=...)"
                )
            annotation = declared.recipe_type if declared.recipe_type is not None else hints[f.name]
            specs.append(
                OptionSpec(
                    self.recipe.section,
                    self.option_key(f),
                    f.default,
                    annotation,
                    declared.doc,
                    declared.changes_trajectory,
                    dict(declared.bounds),
                )
            )
        return specs


@dataclass(frozen=True)
class _Declared:
    doc: str
    changes_trajectory: bool
    recipe_type: Any
    bounds: tuple[tuple[str, Any], ...]


def option(
    default: Any,
    *,
    doc: str,
    changes_trajectory: bool,
    recipe_key: str | None = None,
    recipe_type: Any = None,
    **bounds: Any,
) -> Any:
    """A strategy field that is a recipe option, declared once: its default, a line for the docs and the
    schema, whether changing it on a resume changes the training (False: memory or speed only), the key
    it is read from (default `<kind>_<field name>` in the kind's section), the type a recipe gives when
    it differs from the field's (e.g. a list for a tuple), and pydantic bounds (`gt`, `ge`, `lt`, `le`)."""
    declared = _Declared(doc, changes_trajectory, recipe_type, tuple(sorted(bounds.items())))
    metadata: dict[str, Any] = {"option": declared}
    if recipe_key:
        metadata["recipe_key"] = recipe_key
    return dataclasses.field(default=default, metadata=metadata)
