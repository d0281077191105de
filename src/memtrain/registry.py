"""A name -> entry registry for loggers, learning-rate schedules and data sources.

Why: each of these used to be spelled in several places (a `Literal` in the recipe, a tuple of names, a
map of builders, an `if` chain per use). A registry holds each entry once, under the name a recipe
types, so a new one is one file plus one `register` line, and everything that lists or checks names
(recipe validation, the JSON schema, `memtrain validate`) reads them from here.

Strategies have a richer registry of their own (`memtrain.strategies.registry`: options read from the
`strategies:` section, plan.json round trips); this one only maps a name to an entry. It imports nothing
of memtrain but the errors, so the recipe and everything above it may use it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from memtrain.errors import RecipeError, did_you_mean, shortened


class Named(Protocol):
    """An entry: anything with the name a recipe gives it."""

    @property
    def name(self) -> str: ...


E = TypeVar("E", bound=Named)


class Registry(Generic[E]):
    """The entries of one recipe key (e.g. `train.schedule`), in registration order."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._entries: dict[str, E] = {}

    def register(self, entry: E) -> E:
        """Add `entry` under its name, which must be new to this registry."""
        if not entry.name or entry.name in self._entries:
            raise ValueError(f"{self.key}: name {entry.name!r} is empty or taken")
        self._entries[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove a name (tests that register a toy entry clean up with this)."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self) -> Iterator[E]:
        return iter(tuple(self._entries.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def unknown(self, name: str) -> str:
        """Why `name` is no entry, without the key: the registered names and a did-you-mean."""
        listed = ", ".join(self._entries)
        return f"{shortened(name)} is not one of {listed}{did_you_mean(name, self._entries)}"

    def get(self, name: str) -> E:
        """The entry named `name`, or a one-line `RecipeError` naming the key."""
        entry = self._entries.get(name)
        if entry is None:
            raise RecipeError([f"{self.key}: {self.unknown(name)}"])
        return entry
