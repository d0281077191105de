"""Recipe fuzzing: mutated recipes through `memtrain validate` and `memtrain train`.

Why: a recipe is the one input every user writes by hand. Whatever is wrong in it — a wrong type, an
unknown or missing key, a negative or absurd number, a wrong enum value, broken YAML, a list where a
mapping belongs, nesting hundreds of levels deep, unicode look-alikes — must end as one message that
names the key (or the YAML line), exit code 2, and no traceback; and YAML must be read only with a safe
loader, so a recipe can never run code.

The mutations are drawn from the recipe's own schema (`CausalLMRecipe.model_fields`: every leaf key, its type
and its bounds), so a key added later is fuzzed too. Each mutant records what its error must contain.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ByteSize

import memtrain
from memtrain import cli
from memtrain.causal_lm.recipe import CausalLMRecipe

from fault_kit.scenarios import TINY_LLAMA, Outcome, in_process, timed


@dataclass(frozen=True)
class Leaf:
    key: str  # dotted path
    kind: str  # int, float, bool, str, enum, tuple, dict, list, bytes
    choices: tuple[str, ...]  # enum values
    takes_list: bool  # an enum field that also takes a list of its values
    lower: float | None  # a bound from Gt/Ge
    upper: float | None  # a bound from Lt/Le


@dataclass(frozen=True)
class Mutant:
    kind: str  # the mutation family (a row of the breakdown)
    label: str  # what was changed
    text: str  # the recipe file
    expect: str  # what the error message must contain
    overrides: tuple[str, ...] = ()


def leaves(model: type[BaseModel] = CausalLMRecipe, prefix: str = "") -> Iterator[Leaf]:
    """Every leaf key of the recipe schema with its kind and bounds."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from leaves(annotation, f"{prefix}{name}.")
            continue
        choices = tuple(_literals(annotation))
        bounds = info.metadata
        yield Leaf(
            key=f"{prefix}{name}",
            kind="enum" if choices else _kind(annotation),
            choices=choices,
            takes_list=any(get_origin(a) is list for a in get_args(annotation)),
            lower=next(
                (float(getattr(m, "gt", getattr(m, "ge", 0))) for m in bounds if isinstance(m, (Gt, Ge))),
                None,
            ),
            upper=next(
                (float(getattr(m, "lt", getattr(m, "le", 0))) for m in bounds if isinstance(m, (Lt, Le))),
                None,
            ),
        )


def _literals(annotation: Any) -> Iterator[str]:
    if get_origin(annotation) is Literal:
        yield from (a for a in get_args(annotation) if isinstance(a, str))
    elif get_origin(annotation) in (Union, UnionType, list):
        for arg in get_args(annotation):
            yield from _literals(arg)


def _kind(annotation: Any) -> str:
    union = get_origin(annotation) in (Union, UnionType)
    base = next(a for a in get_args(annotation) if a is not type(None)) if union else annotation
    if base is ByteSize:
        return "bytes"
    origin = get_origin(base)
    if origin in (tuple, dict, list):
        return {tuple: "tuple", dict: "dict", list: "list"}[origin]
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(base, "str")


WRONG_TYPES: dict[str, list[Any]] = {
    "int": ["twelve", [1, 2], {"a": 1}, 1.5, "１２", "0x1G"],
    "float": ["fast", [0.1], {"a": 1}, "∞", "1,5"],
    "bool": ["maybe", 2, [True], {"a": 1}, "ja", 0.5],
    "str": [123, [1], {"a": 1}, True, 1.5],
    "tuple": ["x", [0.9], [0.9, "a"], [0.9, 0.95, 0.99], {"a": 1}],
    "dict": ["notadict", [1], 5],
    "list": ["x", ["a"], [2.0], [], {"a": 1}],
    "bytes": ["lots", [1], {"a": 1}, "12 parsecs"],
    "enum": ["5 5", {"a": 1}, 2.5],  # not 5: batch.micro_size takes an integer too
}
UNICODE_WORDS = ("ключ", "clé_inconnue", "名前", "🚀", "ｔｒａｉｎ", "stéps", "ӏr")  # the last: Cyrillic "l"
MODEL_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def base_recipe(run_dir: Path) -> dict[str, Any]:
    """A valid tiny recipe; every mutant starts from it."""
    return {
        "run": {"name": "fuzz", "output_dir": str(run_dir), "seed": 3},
        "model": {"config": dict(TINY_LLAMA)},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 64, "min_len": 4}},
        "batch": {"global_size": 8, "micro_size": 4},
        "train": {"steps": 2, "lr": 1e-2},
        "output": {"progress": "off"},
    }


def _set(raw: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _drop(raw: dict[str, Any], key: str) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    del node[last]
    return out


def _dump(raw: dict[str, Any]) -> str:
    return yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)


def _typo(word: str, rng: random.Random) -> str:
    """A near miss of `word` (two letters swapped, or one dropped), never `word` itself."""
    i = rng.randrange(max(len(word) - 1, 1))
    typo = (
        word[:i] + word[i + 1 : i + 2] + word[i] + word[i + 2 :]
        if rng.random() < 0.5
        else word[:i] + word[i + 1 :]
    )
    return typo if typo != word and typo else word + "x"


def _homoglyph(word: str) -> str:
    return word.translate(str.maketrans("aeopcx", "аеорсх"))  # Latin letters swapped for Cyrillic twins


# ------------------------------------------------------------------------------------------- families


def wrong_type(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    leaf = rng.choice(fields)
    value = rng.choice(WRONG_TYPES[leaf.kind])
    return Mutant("wrong type", f"{leaf.key}={value!r}", _dump(_set(raw, leaf.key, value)), leaf.key)


def unknown_key(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    leaf = rng.choice(fields)
    parent, _, name = leaf.key.rpartition(".")
    word = _typo(name, rng) if rng.random() < 0.6 else rng.choice(UNICODE_WORDS)
    if word == name:
        word += "_x"
    if rng.random() < 0.2:  # a misspelt model config field: transformers would silently keep it
        parent, word = "model.config", _typo(rng.choice(MODEL_SIZES), rng)
    key = f"{parent}.{word}" if parent else word
    return Mutant("unknown key", key, _dump(_set(raw, key, 1)), key)


def missing_key(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    form = rng.randrange(5)
    noise = _set(raw, "train.steps", rng.randint(1, 50))  # keeps the mutants distinct
    if form == 0:
        return Mutant("missing key", "no model section", _dump(_drop(noise, "model")), "model")
    if form == 1:
        return Mutant("missing key", "model.config: null", _dump(_set(noise, "model.config", None)), "model")
    if form == 2:
        return Mutant(
            "missing key",
            "no model.config.model_type",
            _dump(_drop(noise, "model.config.model_type")),
            "model.config.model_type",
        )
    source = rng.choice(("text", "jsonl"))
    return Mutant(
        "missing key",
        f"data.source={source} without data.path",
        _dump(_set(noise, "data.source", source)),
        "data.path",
    )


def negative_number(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    if rng.random() < 0.25:
        key = f"model.config.{rng.choice(MODEL_SIZES)}"
        value: float = -rng.randint(1, 10**6)
    else:
        leaf = rng.choice([f for f in fields if f.lower is not None and f.kind in ("int", "float")])
        key = leaf.key
        value = -rng.randint(1, 10**6) if leaf.kind == "int" else -round(rng.uniform(1e-6, 1e6), 6)
    return Mutant("negative number", f"{key}={value}", _dump(_set(raw, key, value)), key)


def huge_number(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    form = rng.randrange(4)
    if form == 0:
        leaf = rng.choice([f for f in fields if f.upper is not None])
        key, value = (
            leaf.key,
            (10 ** rng.randint(10, 40) if leaf.kind == "int" else 10.0 ** rng.randint(3, 300)),
        )
    elif form == 1:
        key, value = rng.choice([f.key for f in fields if f.kind == "float"]), float("inf")
    elif form == 2:
        key, value = "batch.micro_size", rng.randint(9, 10**12)  # more than the global batch
    else:
        key, value = "data.seq_len", rng.randint(65, 10**12)  # more than the model's positions
    return Mutant("huge number", f"{key}={value}", _dump(_set(raw, key, value)), key)


def wrong_enum(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    leaf = rng.choice([f for f in fields if f.kind == "enum"])
    valid = rng.choice([c for c in leaf.choices if c != "auto"] or list(leaf.choices))
    wrong = rng.choice(
        [
            _typo(valid, rng),
            valid.upper() + "!",
            _homoglyph(valid) if _homoglyph(valid) != valid else valid + "2",
            valid + "-v2",
        ]
    )
    value: Any = [valid, wrong] if leaf.takes_list and rng.random() < 0.3 else wrong
    return Mutant("wrong enum value", f"{leaf.key}={value!r}", _dump(_set(raw, leaf.key, value)), leaf.key)


BROKEN_YAML: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("unclosed flow sequence", lambda t: t + "extra: [1, 2\n"),
    ("unclosed flow mapping", lambda t: t + "extra: {a: 1\n"),
    ("tab indentation", lambda t: t.replace("\n  ", "\n\t", 1)),
    ("unterminated quote", lambda t: t + 'extra: "abc\n'),
    ("mapping in a plain scalar", lambda t: t + "extra: a: b: c\n"),
    ("bad indentation", lambda t: re.sub(r"\n  (\w)", r"\n   \1", t, count=1)),
    ("undefined alias", lambda t: t + "extra: *nowhere\n"),
    ("NUL character", lambda t: t.replace("seed", "se\x00ed", 1)),
    ("sequence item in a mapping", lambda t: t + "- item\n"),
)


def broken_yaml(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    name, breaker = rng.choice(BROKEN_YAML)
    noisy = _set(raw, "train.steps", rng.randint(1, 50))
    return Mutant("broken YAML", name, breaker(_dump(noisy)), "malformed YAML at line")


def code_in_yaml(rng: random.Random, raw: dict[str, Any], fields: list[Leaf], marker: Path) -> Mutant:
    tag = rng.choice(("!!python/object/apply:pathlib.Path.touch", "!!python/object/apply:os.system"))
    arg = f"['{marker}']" if "touch" in tag else f"['touch {marker}']"
    key = rng.choice(("run.name", "train.steps", "extra"))
    section, _, name = key.rpartition(".")
    rest = {k: v for k, v in raw.items() if k != section}  # the section once: a repeated key is refused
    text = _dump(rest) + (f"{section}:\n  {name}: {tag} {arg}\n" if section else f"{name}: {tag} {arg}\n")
    return Mutant("python tag (must not run)", tag, text, "malformed YAML at line")


def non_mapping(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    text = rng.choice(
        ("- run\n- model\n", "42\n", "just a string\n", "[1, 2, 3]\n", "'quoted'\n", "3.5\n", "true\n")
    )
    return Mutant("non-mapping top level", text.strip(), text, "the top level must be a mapping")


def deep_nesting(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    depth = rng.choice((rng.randint(5, 200), rng.randint(600, 5000)))
    leaf = rng.choice(fields)
    section, _, name = leaf.key.partition(".")
    opener, closer = ("{a: ", "}") if rng.random() < 0.5 else ("[", "]")
    value = opener * depth + "1" + closer * depth
    if leaf.key.count(".") > 1:  # keep it one level under a section: the nested value is the whole section
        name = leaf.key.split(".")[1]
    rest = {k: v for k, v in raw.items() if k != section}  # the section once: a repeated key is refused
    text = _dump(rest) + f"{section}:\n  {name}: {value}\n"
    expect = "nested too deeply" if depth >= 500 else f"{section}.{name}"
    return Mutant("deep nesting", f"{section}.{name} nested {depth} deep", text, expect)


def unicode_value(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    form = rng.randrange(3)
    if form == 0:
        leaf = rng.choice([f for f in fields if f.kind in ("int", "float")])
        value: Any = rng.choice(("１２", "٣", "五", "1e-3\u200b", "½"))
    elif form == 1:
        leaf = rng.choice([f for f in fields if f.kind == "enum"])
        value = (
            _homoglyph(leaf.choices[0])
            if _homoglyph(leaf.choices[0]) != leaf.choices[0]
            else leaf.choices[0] + "™"
        )
    else:
        leaf = rng.choice([f for f in fields if f.kind == "bool"])
        value = rng.choice(("ДА", "はい", "✓"))
    return Mutant("unicode value", f"{leaf.key}={value!r}", _dump(_set(raw, leaf.key, value)), leaf.key)


def not_utf8(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    data = _dump(raw).encode("utf-8")
    cut = rng.randrange(len(data))
    text = (data[:cut] + bytes([0xFF, 0xFE, 0x80]) + data[cut:]).decode("latin-1")
    return Mutant("not UTF-8", f"bytes ff fe 80 at {cut}", text, "UTF-8")


def bad_override(rng: random.Random, raw: dict[str, Any], fields: list[Leaf]) -> Mutant:
    leaf = rng.choice([f for f in fields if f.kind in ("int", "float", "bool")])
    override, expect = rng.choice(
        (
            (leaf.key, leaf.key),  # no '='
            (f"{leaf.key}.sub=1", leaf.key),  # a value used as a section
            (f"{leaf.key}={rng.choice(WRONG_TYPES[leaf.kind])}", leaf.key),
            (f"={rng.randint(0, 9)}", "expected key.path=value"),
        )
    )
    return Mutant("bad override", override, _dump(raw), expect, (override,))


FAMILIES: tuple[Callable[[random.Random, dict[str, Any], list[Leaf]], Mutant], ...] = (
    wrong_type,
    unknown_key,
    missing_key,
    negative_number,
    huge_number,
    wrong_enum,
    broken_yaml,
    non_mapping,
    deep_nesting,
    unicode_value,
    not_utf8,
    bad_override,
)


def mutants(count: int, seed: int, run_dir: Path, marker: Path) -> list[Mutant]:
    """`count` mutants, the families in turn (a python-tag mutant every 20th)."""
    rng = random.Random(f"{seed}-fuzz")
    fields = list(leaves())
    out = []
    for index in range(count):
        raw = base_recipe(run_dir / f"m{index:03d}")
        if index % 20 == 19:
            out.append(code_in_yaml(rng, raw, fields, marker))
        else:
            out.append(FAMILIES[index % len(FAMILIES)](rng, raw, fields))
    return out


def unsafe_yaml_loads() -> list[str]:
    """Source lines in memtrain that load YAML with anything but `yaml.safe_load`."""
    pattern = re.compile(
        r"yaml\.(load|unsafe_load|full_load|load_all|unsafe_load_all|full_load_all)\(|Loader\s*="
    )
    return [
        f"{path.name}:{number}"
        for path in sorted(Path(memtrain.__file__).parent.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if pattern.search(line.split("#")[0])
    ]


def recipe_fuzz(work: Path, count: int, seed: int) -> Outcome:
    """Every mutant through `memtrain validate` and `memtrain train` (in this process): exit 2, one
    message containing what the mutant says it must, no traceback, and no code run from YAML."""
    outcome = Outcome("recipe fuzzing", "mutated recipes through memtrain validate and memtrain train")
    with timed(outcome):
        marker = work / "yaml-ran-code"
        base = work / "base.yaml"
        base.write_text(_dump(base_recipe(work / "base-run")), encoding="utf-8")
        rc, _, err = in_process(cli.main, ["validate", str(base)])
        if rc != 0:  # every mutant would fail for the wrong reason
            outcome.failures.append(f"base recipe: the unmutated recipe does not validate: {rc} {err}")
            return outcome
        outcome.figures["tracebacks"] = 0
        for index, mutant in enumerate(mutants(count, seed, work, marker)):
            path = work / f"mutant{index:03d}.yaml"
            path.write_bytes(mutant.text.encode("latin-1" if mutant.kind == "not UTF-8" else "utf-8"))
            problems = []
            for command in ("validate", "train"):
                rc, _, err = in_process(cli.main, [command, str(path), *mutant.overrides])
                if isinstance(rc, str):
                    problems.append(f"{command}: {rc}")
                    outcome.count("tracebacks")
                elif rc != 2 or mutant.expect not in err or "Traceback" in err:
                    problems.append(f"{command}: exit {rc}, message {err.strip()[:300]!r}")
            if marker.exists():
                problems.append("a YAML tag ran code")
            outcome.record("; ".join(problems) or None, f"#{index} {mutant.kind}: {mutant.label[:120]}")
            outcome.count(f"{mutant.kind}")
        outcome.figures["clear errors naming the key (validate + train)"] = 2 * outcome.passed
        outcome.figures["YAML loaders other than yaml.safe_load"] = len(unsafe_yaml_loads())
        if unsafe_yaml_loads():
            outcome.record(f"unsafe YAML loads at {unsafe_yaml_loads()}", "static check")
    return outcome
