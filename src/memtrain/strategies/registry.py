"""The `Strategy` base and one name -> class registry per kind: the only vocabulary of strategy names.

Why a registry: the recipe schema, the CLI help, the planner's grid and the docs all need the list of
names a kind has, and every place that turns a name into behaviour needs the class. Both come from here,
so a new strategy is one file (a frozen dataclass subclassing its kind's base) plus one registry line
(`CHECKPOINTING.register(MyMode)`, or the decorator form); nothing else changes.

A strategy is a small frozen dataclass. Its class attribute `name` is what a recipe types; its fields
are its recipe options. Each field is read from the flat `strategies:` key named by the field's
`recipe_key` metadata (default `<kind>_<field>`, e.g. `checkpointing_fraction`), so the YAML stays flat.
Every strategy has `check(facts)`, which raises `Unsupported` naming the key to change when it cannot run
on a device, and `to_dict()` / `Registry.from_dict()` for plan.json and checkpoint metadata.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from memtrain.errors import Unsupported, did_you_mean


@dataclass(frozen=True)
class DeviceFacts:
    """What a strategy's `check` may ask about where the plan runs: a real device, or one described by a
    what-if (`memtrain plan --gpu ...`), whose capabilities come from its profile instead of CUDA."""

    device_type: str
    world_size: int = 1
    bf16: bool = True
    fp8: bool = False
    what_if: bool = False

    @classmethod
    def of(cls, device: torch.device, world_size: int = 1) -> DeviceFacts:
        """The facts of a device present in this process."""
        if device.type != "cuda":
            return cls(device.type, world_size, bf16=True, fp8=False)
        capability = torch.cuda.get_device_capability(device)
        return cls("cuda", world_size, bf16=torch.cuda.is_bf16_supported(), fp8=capability >= (8, 9))


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


class Registry(Generic[S]):
    """Names of one kind, in registration order, and the class behind each."""

    def __init__(self, kind: str, base: type[S]) -> None:
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[S]] = {}

    def register(self, cls: type[S]) -> type[S]:
        """Add a strategy class (usable as a decorator). Its `name` must be new to this kind."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__}")
        if not cls.name or cls.name == "auto" or cls.name in self._classes:
            raise ValueError(f"strategies.{self.kind}: name {cls.name!r} is empty, reserved or taken")
        self._classes[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a name (tests that register a toy strategy clean up with this)."""
        self._classes.pop(name, None)

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

    def create(self, name: str, options: Mapping[str, Any] | None = None) -> S:
        """The strategy `name` with its options read from the recipe's flat `strategies:` mapping."""
        cls = self.get(name)
        given = options or {}
        values = {}
        for f in dataclasses.fields(cls):
            key = f.metadata.get("recipe_key", f"{self.kind}_{f.name}")
            if key in given:
                values[f.name] = given[key]
        return cls(**values)

    def from_dict(self, data: Mapping[str, Any]) -> S:
        """The inverse of `Strategy.to_dict` (plan.json, checkpoint metadata)."""
        cls = self.get(str(data.get("name")))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def option(default: Any, recipe_key: str | None = None) -> Any:
    """A strategy field read from `strategies.<recipe_key>` (default `<kind>_<field name>`)."""
    metadata = {"recipe_key": recipe_key} if recipe_key else {}
    return dataclasses.field(default=default, metadata=metadata)
