"""The house: one-way imports inside src/memtrain, checked from the source (every import statement,
function-level ones included), so an arrow the design forbids fails here before it tangles the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import _parser
from memtrain.recipe import Recipe
from memtrain.run import CheckpointFiles, RunLayout
from memtrain.run.lineage import RUN_FREE_KEYS, all_free_keys
from memtrain.strategies.catalog import RECIPE_KINDS, REGISTRIES, declared_keys, free_keys, options_table

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
                "memtrain.run",
            ),
        ),
        ("memtrain.checkpoint", ("memtrain.run", "memtrain.training", "memtrain.strategies")),
        (
            "memtrain.run",
            ("memtrain.training", "memtrain.causal_lm", "memtrain.planner", "memtrain.commands"),
        ),
        (
            "memtrain.recipe",
            (
                "memtrain.training",
                "memtrain.causal_lm",
                "memtrain.planner",
                "memtrain.commands",
                "memtrain.cli",
            ),
        ),
        *(
            (registry, ("memtrain.recipe", "memtrain.training", "memtrain.causal_lm", "memtrain.planner"))
            for registry in ("memtrain.registry", "memtrain.loggers", "memtrain.schedules")
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
    trainer, the planner or the recipe; the recipe reaches none of those, and the registries it validates
    names with (loggers, schedules) do not reach the recipe; memory measurement reaches none of them."""
    graph = _graph()
    for module in (m for m in graph if m == package or m.startswith(package + ".")):
        bad = sorted(t for t in _reachable(graph, module) if t.startswith(forbidden))
        assert not bad, f"{module} reaches {bad}"


def test_registries_are_the_one_vocabulary() -> None:
    """The recipe schema, the CLI help and docs/STRATEGIES.md list exactly what the registries hold."""
    schema = Recipe.editor_schema()["$defs"]["StrategiesConfig"]["properties"]
    help_text = " ".join(_parser().format_help().split())
    docs = (REPO / "docs/STRATEGIES.md").read_text()
    for kind in RECIPE_KINDS:
        names = REGISTRIES[kind].names()
        assert schema[kind]["anyOf"][0]["enum"] == ["auto", *names], kind
        assert f"{kind}: {', '.join(names)}" in help_text, kind
        for name in names:
            assert f"`{name}`" in docs, f"docs/STRATEGIES.md does not describe {kind} {name!r}"


def _run_file_names() -> tuple[set[str], set[str], tuple[str, ...]]:
    """(file names, folder names, name prefixes) that `memtrain.run.layout` gives a run directory and a
    checkpoint: read from the layout itself, so a name added there is checked here too."""
    root = Path("RUN")
    layout, files_in_checkpoint = RunLayout(root), CheckpointFiles(root)
    paths = [getattr(layout, name) for name, v in vars(RunLayout).items() if isinstance(v, property)]
    paths += [
        getattr(files_in_checkpoint, n) for n, v in vars(CheckpointFiles).items() if isinstance(v, property)
    ]
    names = {p.relative_to(root).parts[0] for p in paths if isinstance(p, Path)}
    prefixes = (layout.recipe_backup(7).name.split("7")[0], files_in_checkpoint.rng(7).name.split("7")[0])
    return (
        {n for n in names if "." in n.lstrip(".")},
        {n for n in names if "." not in n.lstrip(".")},
        prefixes,
    )


def _path_literals(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, text, joined) of every string literal that is not a docstring; `joined` when it is an operand
    of `/` or an argument of a path-building call (joinpath, with_name, os.path.join, Path)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    joined: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            joined |= {id(node.left), id(node.right)}
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if name in ("joinpath", "with_name", "join", "Path"):
                joined |= {id(arg) for arg in node.args}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value, id(node) in joined))
        elif isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                found.append((node.lineno, head.value, id(node) in joined))
    return found


def test_only_the_run_package_names_files_inside_a_run_directory() -> None:
    """A run directory's layout is known in one place (`memtrain.run`): no other module spells a file of
    it (recipe.json, plan.json, metrics.jsonl, meta.json, ...), joins a folder of it (checkpoints,
    abandoned, hf, ...) onto a path, or builds one of its numbered names (rng_rank<r>.pt, recipe.<n>.json)."""
    files, folders, prefixes = _run_file_names()
    assert {"recipe.json", "meta.json", "metrics.jsonl"} <= files and "checkpoints" in folders, (
        files,
        folders,
    )
    offenders = []
    for path in SRC.joinpath("memtrain").rglob("*.py"):
        if _module_name(path).startswith("memtrain.run"):
            continue
        for line, text, joined in _path_literals(ast.parse(path.read_text())):
            first = text.split("/")[0]
            if text in files or (
                joined and (first in folders or first in files or text.startswith(prefixes))
            ):
                offenders.append(f"{path.relative_to(SRC)}:{line}: {text!r}")
    assert not offenders, "ask memtrain.run.RunLayout for these paths:\n" + "\n".join(offenders)


MAX_LOOP_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def test_the_trainer_is_the_loop() -> None:
    """The loop's file stays readable in one sitting, and no function in `training/` outgrows a screen."""
    trainer = SRC / "memtrain/training/trainer.py"
    assert len(trainer.read_text().splitlines()) <= MAX_LOOP_FILE_LINES
    long = []
    for path in SRC.joinpath("memtrain/training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


HAND_WRITTEN = {  # recipe class -> section -> the hand-written classes its generated section builds on
    Recipe: {
        "model": [("recipe.py", "ModelSection")],
        "strategies": [("recipe.py", "_StrategiesSection")],
        "adapters": [("recipe.py", "_AdaptersSection")],
        "optimizer": [("recipe.py", "_OptimizerSection")],
    },
    CausalLMRecipe: {
        "model": [("recipe.py", "ModelSection"), ("causal_lm/recipe.py", "CausalLMModelSection")],
    },
}


def test_strategy_keys_are_declared_once_and_generated_everywhere() -> None:
    """A strategy's recipe keys (each kind's choice and its options) are declared once, on the strategy
    (`option(...)`) and its registry (`RecipeKey`): the recipe sections hold exactly those keys and none
    written by hand in recipe.py, the run lineage's hand-written free keys name none of them, and the table
    in docs/STRATEGIES.md is the generated one."""
    declared = {key.path for key in declared_keys()}
    for recipe_class in HAND_WRITTEN:
        sections = {**HAND_WRITTEN[Recipe], **HAND_WRITTEN[recipe_class]}
        fields = {
            f"{section}.{name}"
            for section in sections
            for name in recipe_class.model_fields[section].annotation.model_fields  # type: ignore[union-attr]
        }
        hand_fields = {
            f"{section}.{node.target.id}"
            for section, classes in sections.items()
            for path, cls in classes
            for node in _class_body(SRC / "memtrain" / path, cls)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }
        assert declared <= fields, (recipe_class, declared - fields)
        assert not declared & hand_fields, (
            f"declared by a strategy, written again by hand: {declared & hand_fields}"
        )
        assert fields - hand_fields == declared, (recipe_class, (fields - hand_fields) ^ declared)
    by_hand = [k for k in RUN_FREE_KEYS for d in declared if d == k or d.startswith(k + ".")]
    assert not by_hand, f"strategy keys in run/lineage.py's RUN_FREE_KEYS, written by hand: {by_hand}"
    assert set(all_free_keys()) == set(RUN_FREE_KEYS) | set(free_keys())
    docs = (REPO / "docs/STRATEGIES.md").read_text()
    block = docs.split("<!-- strategy-keys:begin -->\n")[1].split("<!-- strategy-keys:end -->")[0]
    assert block == options_table(), "refresh the table: python -m memtrain.strategies.catalog"
    outside = docs.replace(block, "")
    rows = [line for line in outside.splitlines() if any(line.startswith(f"| `{k}`") for k in declared)]
    assert not rows, f"rows for declared keys written by hand in docs/STRATEGIES.md: {rows}"


CAUSAL_LM_KEYS = re.compile(
    r"\b(recipe\.data\b|model\.(config|config_path|pretrained|attn_implementation)\b)"
)


def test_the_causal_lm_sections_are_the_causal_lm_trainers_own() -> None:
    """`model.config`/`pretrained`/... and `data:` belong to the built-in trainer's recipe part
    (`causal_lm.recipe.CausalLMRecipe`): the recipe every trainer reads has no such key, its `model:`
    holds only the strategy-declared quantization keys, and no module outside memtrain.causal_lm reads
    them."""
    assert "data" not in Recipe.model_fields
    generic_model = {f"model.{name}" for name in Recipe.model_fields["model"].annotation.model_fields}  # type: ignore[union-attr]
    assert generic_model == {key.path for key in declared_keys() if key.path.startswith("model.")}
    assert {"data", "model"} <= set(CausalLMRecipe.model_fields)
    assert CausalLMTrainer.recipe_class is CausalLMRecipe
    readers = [
        f"{path.relative_to(SRC)}:{number}"
        for path in sorted((SRC / "memtrain").rglob("*.py"))
        if "causal_lm" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CAUSAL_LM_KEYS.search(line) and not line.lstrip().startswith(("#", '"'))
    ]
    assert not readers, f"causal-LM recipe keys read outside memtrain.causal_lm: {readers}"


def _class_body(path: Path, name: str) -> list[ast.stmt]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.body
    raise AssertionError(f"{path} has no class {name}")
