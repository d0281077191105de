"""The house: one-way imports inside src/memtrain, checked from the source (every import statement,
function-level ones included), so an arrow the design forbids fails here before it tangles the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memtrain.cli import _parser
from memtrain.recipe import json_schema
from memtrain.strategies.catalog import RECIPE_KINDS, REGISTRIES

from helpers import REPO

SRC = REPO / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """memtrain module -> the memtrain modules it imports (a `from package import name` of a submodule
    counts as an import of that submodule)."""
    files = {_module_name(p): p for p in SRC.joinpath("memtrain").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1]
                        + ([base] if base else [])
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_no_import_circles() -> None:
    graph = _graph()
    circles = sorted(m for m in graph if m in _reachable(graph, m))
    assert not circles, f"modules on an import circle: {circles}"


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        (
            "memtrain.planner",
            ("memtrain.training", "memtrain.causal_lm", "memtrain.commands", "memtrain.cli"),
        ),
        (
            "memtrain.strategies",
            (
                "memtrain.training",
                "memtrain.causal_lm",
                "memtrain.planner",
                "memtrain.commands",
                "memtrain.recipe",
                "memtrain.plan",
            ),
        ),
        (
            "memtrain.memory",
            (
                "memtrain.training",
                "memtrain.causal_lm",
                "memtrain.planner",
                "memtrain.strategies",
                "memtrain.recipe",
                "memtrain.plan",
            ),
        ),
    ],
)
def test_one_way_arrows(package: str, forbidden: tuple[str, ...]) -> None:
    """The planner never reaches the trainer or the built-in model module; strategies never reach the
    trainer, the planner or the recipe; memory measurement reaches none of them."""
    graph = _graph()
    for module in (m for m in graph if m == package or m.startswith(package + ".")):
        bad = sorted(t for t in _reachable(graph, module) if t.startswith(forbidden))
        assert not bad, f"{module} reaches {bad}"


def test_registries_are_the_one_vocabulary() -> None:
    """The recipe schema, the CLI help and docs/STRATEGIES.md list exactly what the registries hold."""
    schema = json_schema()["$defs"]["StrategiesConfig"]["properties"]
    help_text = " ".join(_parser().format_help().split())
    docs = (REPO / "docs/STRATEGIES.md").read_text()
    for kind in RECIPE_KINDS:
        names = REGISTRIES[kind].names()
        assert schema[kind]["anyOf"][0]["enum"] == ["auto", *names], kind
        assert f"{kind}: {', '.join(names)}" in help_text, kind
        for name in names:
            assert f"`{name}`" in docs, f"docs/STRATEGIES.md does not describe {kind} {name!r}"
