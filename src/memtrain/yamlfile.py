"""Bounded YAML: recipes and GPU profiles are read through here, never through a bare `yaml.safe_load`.

Why: YAML aliases repeat what an anchor names, so a "billion laughs" file of a kilobyte expands into
gigabytes inside `yaml.safe_load`'s constructor (15 s and 1 GB at 8 levels, out of memory at 9).
Aliases are shared nodes in the composed graph, so the graph is measured first, each node once, in
microseconds, and refused before any Python object is built when it has more than `MAX_YAML_NODES`
values with every alias expanded, holds more than `MAX_YAML_CHARS` characters of text with every alias
expanded (one 1 MB string aliased 89 times passed the count of values and wrote 352 MiB of run files, each
copy of the recipe in recipe.json, lineage.jsonl and every meta.json), nests deeper than `MAX_YAML_DEPTH`,
or holds an alias inside its own anchor. Files above `MAX_RECIPE_BYTES` are refused before they are read. Construction is SafeLoader's:
no tag runs code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import yaml

from memtrain.errors import RecipeError
from memtrain.jsonfile import mib

MAX_RECIPE_BYTES = 2**20  # a recipe file, and each override's value
MAX_YAML_NODES = 100_000  # values of a recipe with every alias expanded (real recipes have < 1000)
MAX_YAML_DEPTH = 64  # nesting levels of mappings and sequences
MAX_YAML_CHARS = MAX_RECIPE_BYTES  # characters of keys and values, aliases expanded: what a file may hold


def cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, ending in "..." when cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_yaml(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        size = path.stat().st_size if path.is_file() else None
        data = path.read_bytes() if size is not None and size <= MAX_RECIPE_BYTES else b""
    except OSError as exc:
        raise RecipeError([f"cannot read the recipe ({exc.strerror or exc})"], cut(source, 200)) from None
    if size is None:
        raise RecipeError([f"recipe file not found: {path}"], source=source)
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(
            [f"the recipe is {size:,} bytes, over the limit of {mib(MAX_RECIPE_BYTES)} for a recipe"], source
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            [f"not UTF-8 text (byte {exc.start}): save the recipe as UTF-8"], source=source
        ) from None
    try:
        loaded = parse_yaml(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if isinstance(exc, yaml.reader.ReaderError):  # a character YAML forbids: it has a position, no mark
            where = f" at line {text.count(chr(10), 0, exc.position) + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError([f"malformed YAML{where}: {problem}"], source=source) from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise RecipeError(
            [f"the top level must be a mapping of sections, got {type(loaded).__name__}"], source
        )
    return loaded


def parse_yaml(text: str, source: str, key: str = "") -> Any:
    """What `yaml.safe_load(text)` returns, refused with a `RecipeError` before any Python object is built
    when the node graph, aliases expanded, has more than `MAX_YAML_NODES` values, nests deeper than
    `MAX_YAML_DEPTH`, or holds an alias inside its own anchor. `key` is the dotted key the text is the
    value of (an override), for messages. `yaml.YAMLError` for text that is not YAML."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        graph = _GraphSize(source)
        graph.measure(node, [key] if key else [], 0)
        data = loader.construct_document(node)  # safe once the size is bounded; a tag it refuses wins
        if graph.duplicate:  # after the size and the tags: a bomb or a Python tag is reported as itself
            raise RecipeError([graph.duplicate], source)
        return data
    finally:
        loader.dispose()


class _GraphSize:
    """Counts a composed YAML graph's values with every alias expanded, without expanding it: each node's
    expanded size and height are computed once (an alias is the same node object again)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.known: dict[int, tuple[int, int, int]] = {}  # id(node) -> (expanded values, height, chars)
        self.open: set[int] = set()  # nodes being measured (an alias to one of them is a cycle)
        self.duplicate = ""  # the first key given twice in one mapping, as a message

    def measure(self, node: yaml.Node, path: list[str], depth: int) -> tuple[int, int, int]:
        if id(node) in self.open:
            self._refuse(path, "a YAML alias inside its own anchor (a recursive value)")
        size, height, chars = self.known.get(id(node)) or self._expand(node, path, depth)
        if depth + height > MAX_YAML_DEPTH:
            self._refuse(path, f"nested too deeply (more than {MAX_YAML_DEPTH} levels)")
        return size, height, chars

    def _expand(self, node: yaml.Node, path: list[str], depth: int) -> tuple[int, int, int]:
        if isinstance(node, yaml.ScalarNode):
            return 1, 0, len(node.value)
        if depth >= MAX_YAML_DEPTH:
            self._refuse(path, f"nested too deeply (more than {MAX_YAML_DEPTH} levels)")
        if isinstance(node, yaml.MappingNode) and not self.duplicate:
            self.duplicate = _duplicate_key(node, path)
        size, height, chars = 1, 1, 0
        self.open.add(id(node))
        for name, child in _children(node):
            child_size, child_height, child_chars = self.measure(child, [*path, name], depth + 1)
            size, height, chars = size + child_size, max(height, child_height + 1), chars + child_chars
            if size > MAX_YAML_NODES:
                self._refuse(
                    path,
                    f"expands to more than {MAX_YAML_NODES:,} values (YAML aliases repeat what an anchor "
                    "names; a recipe needs far fewer)",
                )
            if chars > MAX_YAML_CHARS:
                self._refuse(
                    path,
                    f"expands to more than {MAX_YAML_CHARS:,} characters of text (YAML aliases repeat what "
                    "an anchor names; memtrain writes the expanded recipe into every checkpoint)",
                )
        self.open.discard(id(node))
        self.known[id(node)] = size, height, chars
        return size, height, chars

    def _refuse(self, path: list[str], problem: str) -> NoReturn:
        where = ".".join(cut(p, 40) for p in path[:3]) + ("..." if len(path) > 3 else "")
        raise RecipeError([f"{where or 'the recipe'}: {problem}"], self.source)


def _children(node: yaml.Node) -> list[tuple[str, yaml.Node]]:
    """A node's children, each with its name in a dotted path (mapping keys count as values too)."""
    if isinstance(node, yaml.SequenceNode):
        return [(str(index), child) for index, child in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        pairs = []
        for key, value in node.value:
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else "<key>"
            pairs += [(name, key), (name, value)]
        return pairs
    return []


def _duplicate_key(node: yaml.MappingNode, path: list[str]) -> str:
    """A key given twice in one mapping, as a message naming both lines ("" when none): YAML keeps the last
    silently, so a recipe that says two things would train one. Merge keys (`<<: *anchor`) may repeat,
    and a key may override a merged one."""
    seen: dict[tuple[str, str], yaml.Node] = {}
    for key, _value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        first = seen.setdefault((key.tag, key.value), key)
        if first is not key:
            where = ".".join(cut(p, 40) for p in [*path, str(key.value)])
            return (
                f"{where}: given twice, at line {first.start_mark.line + 1} and line {key.start_mark.line + 1} "
                "(YAML would keep the last silently); keep one"
            )
    return ""
