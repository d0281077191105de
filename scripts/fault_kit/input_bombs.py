"""Hostile input through `memtrain validate` and `memtrain train`: bombs and undecodable files.

Why: the recipe fuzzer (`recipe_fuzz`) mutates a recipe's values; these scenarios attack the reading
itself. A YAML "billion laughs" of a kilobyte expands to gigabytes when a loader builds it, nesting makes
parsers recurse, a huge file or value is read whole and echoed whole in messages, and every path a
recipe names can hold bytes that are not text. Each case must end as memtrain's own one-line error (exit
2) naming the key, limit or file, with no traceback, within a time bound and a memory bound: the bombs
are refused before they expand, so each case takes well under a second.

- `input_bombs(work, seed)`: alias bombs (several depths; as a string, as a number, inside model.config,
  in an override), nesting bombs (YAML, JSON model config, DeepSpeed JSON) and size bombs (recipe file,
  override value, a value that must be cut in the message, JSON config).
- `undecodable_files(work, seed)`: bytes that are not UTF-8 at every path a recipe names
  (`CausalLMRecipe.path_keys`, each covered, plus the recipe itself, the files of a model.pretrained or
  data.tokenizer directory, every data.source, `--trainer FILE.py` and a `--gpu` profile).

Each command runs in a child forked from this process (`run_bounded`), which is killed when it runs past
its time bound or its resident memory grows past its memory bound, so a regression fails the case, not
the machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import resource
import select
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from memtrain import cli
from memtrain.causal_lm.recipe import CausalLMRecipe

from fault_kit.scenarios import TINY_LLAMA, Outcome, in_process, timed

REPO = Path(__file__).resolve().parents[2]
SECONDS_BOUND = 20.0  # per command; every case is refused before any expansion (< 1 s here)
MEMORY_BOUND = 2**30  # resident bytes a command may add
MESSAGE_BOUND = 3000  # characters of an error message (a long value must be cut)
BAD_BYTES = (b"\xff", b"\xfe\xff", b"\xc3\x28", b"\x80", b"\xed\xa0\x80")  # the last: a UTF-8 surrogate
COMMANDS = ("validate", "train")
DEEPSPEED = {"sharding": "zero2", "sharding_backend": "deepspeed"}
# Without deepspeed installed, train stops first on that (strategies.sharding_backend), so the DeepSpeed
# JSON cases then run through validate alone.
DEEPSPEED_COMMANDS = COMMANDS if importlib.util.find_spec("deepspeed") is not None else ("validate",)


@dataclass(frozen=True)
class Case:
    kind: str  # a row of the breakdown
    label: str
    expect: str  # what the message must contain: the key, the limit or the file
    write: Callable[[Path], list[str]]  # writes the files into a fresh directory; the command's arguments
    commands: tuple[str, ...] = COMMANDS


@dataclass
class Usage:
    seconds: float = 0.0
    grown: int = 0  # the most resident bytes the command added (sampled every 20 ms from its start)


def run_bounded(argv: list[str], seconds: float, extra_bytes: int) -> tuple[int | str, str, Usage]:
    """`in_process(cli.main, argv)` in a forked child (it inherits the imports: no start-up cost), which is
    SIGKILLed once it runs past `seconds` or its resident memory grows by more than `extra_bytes`: a
    bomb spends its time in C code (YAML construction, pydantic-core), where no signal handler runs.
    Returns (exit code, or a "Traceback: ..." line for an escape, a crash or a kill; stderr; usage)."""
    started, usage = time.monotonic(), Usage()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run the command, send its result, leave without any cleanup
        os.close(read_end)
        rc, _, err = in_process(cli.main, argv)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(json.dumps([rc, err]).encode())
        os._exit(0)
    os.close(write_end)
    baseline = _resident(pid)  # after the fork: the child maps the parent's files lazily
    chunks = []
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            if select.select([pipe], [], [], 0.02)[0]:
                chunk = pipe.read(2**16)
                if not chunk:
                    break  # the child has written its result
                chunks.append(chunk)
            usage.grown = max(usage.grown, _resident(pid) - baseline)
            usage.seconds = time.monotonic() - started
            if usage.grown > extra_bytes or usage.seconds > seconds:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                killed = f"{usage.seconds:.1f} s, {usage.grown / 2**20:.0f} MiB more memory"
                return f"Traceback: killed out of bounds after {killed}", "", usage
    _, status = os.waitpid(pid, 0)
    usage.seconds = time.monotonic() - started
    if not chunks:
        return f"Traceback: the command died (wait status {status})", "", usage
    rc, err = json.loads(b"".join(chunks))
    return rc, err, usage


def _resident(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * resource.getpagesize()
    except (FileNotFoundError, ProcessLookupError):  # the child has just exited
        return 0


def run_cases(outcome: Outcome, work: Path, cases: list[Case]) -> Outcome:
    """Every case through its commands: exit 2, `expect` in a short message, no traceback, in bounds."""
    figures = outcome.figures
    figures.update({"cases": 0, "clear errors naming the key": 0, "tracebacks": 0, "max seconds": 0.0})
    figures["max MiB added"] = 0.0
    problem = warm_up(work / "warm-up")
    if problem is not None:
        outcome.failures.append(f"warm-up: a valid recipe does not train: {problem}")
        return outcome
    for index, case in enumerate(cases):
        problems = []
        for command in case.commands:
            where = work / f"case{index:02d}-{command}"
            where.mkdir(parents=True)
            rc, err, usage = run_bounded([command, *case.write(where)], SECONDS_BOUND, MEMORY_BOUND)
            figures["max seconds"] = round(max(figures["max seconds"], usage.seconds), 2)
            figures["max MiB added"] = round(max(figures["max MiB added"], usage.grown / 2**20), 1)
            problem = _problem(rc, err, case.expect)
            if isinstance(rc, str):
                outcome.count("tracebacks")
            if problem is None:
                outcome.count("clear errors naming the key")
            else:
                problems.append(f"{command}: {problem}")
        outcome.count("cases")
        outcome.count(case.kind)
        outcome.record("; ".join(problems) or None, f"#{index} {case.kind}: {case.label}")
    return outcome


def warm_up(where: Path) -> str | None:
    """Validate and train a valid recipe for a step here, so that every child is forked with the modules
    of both commands already imported (each would import them again, for seconds); None when it worked."""
    import datasets  # noqa: F401 - imported by the data.source: dataset cases
    import safetensors.torch  # noqa: F401 - imported by the model.pretrained cases

    where.mkdir(parents=True)
    path = write_recipe(where, recipe(where, train={"steps": 1}))
    for command in COMMANDS:
        rc, _, err = in_process(cli.main, [command, path])
        if rc != 0:
            return f"{command}: exit {rc} {err[-300:]}"
    return None


def _problem(rc: int | str, err: str, expect: str) -> str | None:
    if isinstance(rc, str):
        return rc[:300]
    if rc != 2 or "Traceback" in err or expect not in err:
        return f"exit {rc}, expected {expect!r} in {err.strip()[-300:]!r}"
    if len(err) > MESSAGE_BOUND:
        return f"a message of {len(err):,} characters (a value echoed in full?)"
    return None


# ------------------------------------------------------------------------------------------ recipes


def recipe(where: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A valid tiny recipe writing into `where`; `sections` are merged over it."""
    raw: dict[str, Any] = {
        "run": {"name": "bomb", "output_dir": str(where / "run"), "seed": 0},
        "model": {"config": {**TINY_LLAMA, "vocab_size": 320}},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 64}},
        "batch": {"global_size": 8, "micro_size": 8},
        "train": {"steps": 2, "lr": 1e-2},
        "output": {"progress": "off"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def write_recipe(where: Path, raw: dict[str, Any], tail: str = "") -> str:
    path = where / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False) + tail, encoding="utf-8")
    return str(path)


# -------------------------------------------------------------------------------------------- bombs


def anchors(levels: int, width: int) -> list[str]:
    """`&a0 [x, ...]`, then each level `width` aliases of the one below: width**levels values."""
    out = [f"&a0 [{', '.join(['x'] * width)}]"]
    out += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return out


def alias_bomb(levels: int, width: int, placement: str) -> Case:
    top = f"*a{levels - 1}"
    definitions = "bombs:\n" + "".join(f"  - {a}\n" for a in anchors(levels, width))
    tails = {
        "string value": f"run:\n  name: {top}\n",
        "number value": f"train:\n  steps: {top}\n",
        "inside model.config": "model:\n  config:\n    rope_scaling: " + top + "\n",
    }

    def write(where: Path) -> list[str]:
        if placement == "override":
            return [write_recipe(where, recipe(where)), f"run.name=[{', '.join(anchors(levels, width))}]"]
        return [write_recipe(where, recipe(where), definitions + tails[placement])]

    size = f"{width}**{levels} = {width**levels:,} values"
    return Case("alias bomb", f"{placement}, {size}", "expands to more than", write)


def yaml_nesting(depth: int) -> Case:
    def write(where: Path) -> list[str]:
        return [write_recipe(where, recipe(where), f"data:\n  seq_len: {'[' * depth}1{']' * depth}\n")]

    return Case("nesting bomb", f"YAML nested {depth} deep", "nested too deeply", write)


def json_file_case(kind: str, label: str, key: str, content: Callable[[], str], expect: str) -> Case:
    """A JSON file at `key` (model.config_path or strategies.deepspeed_config) holding `content()`."""

    def write(where: Path) -> list[str]:
        file = where / "file.json"
        file.write_text(content(), encoding="utf-8")
        raw = recipe(where)
        if key == "model.config_path":
            raw["model"] = {"config_path": str(file)}
        else:
            raw["strategies"] = {**DEEPSPEED, "deepspeed_config": str(file)}
        return [write_recipe(where, raw)]

    return Case(kind, label, expect, write, DEEPSPEED_COMMANDS if key != "model.config_path" else COMMANDS)


def json_nesting(key: str, depth: int) -> Case:
    return json_file_case(
        "nesting bomb",
        f"{key} JSON nested {depth} deep",
        key,
        lambda: '{"a": ' * depth + "1" + "}" * depth,
        "nested more than 64 levels deep",
    )


def size_bombs() -> list[Case]:
    def big_recipe(where: Path) -> list[str]:
        return [write_recipe(where, recipe(where), f"extra: {'x' * (2**20 + 1)}\n")]

    def big_override(where: Path) -> list[str]:
        return [write_recipe(where, recipe(where)), "run.name=" + "n" * 5_000_000]

    def long_enum(where: Path) -> list[str]:
        return [write_recipe(where, recipe(where)), "strategies.precision=" + "p" * 500_000]

    def long_name(where: Path) -> list[str]:
        return [write_recipe(where, recipe(where, run={"output_dir": None})), "run.name=" + "n" * 500_000]

    config = json.dumps({**TINY_LLAMA, "padding": "x" * (17 * 2**20)})
    return [
        Case("size bomb", "a 1 MiB + 1 recipe file", "over the limit of 1 MiB for a recipe", big_recipe),
        Case("size bomb", "a 5 MB override value", "override run.name", big_override),
        Case("size bomb", "a 500 kB enum value (cut in the message)", "strategies.precision", long_enum),
        Case("size bomb", "a 500 kB run.name (cut in the message)", "run.name", long_name),
        json_file_case("size bomb", "a 17 MiB model config", "model.config_path", lambda: config, "16 MiB"),
    ]


def input_bombs(work: Path, seed: int, count: int | None = None) -> Outcome:
    """Alias, nesting and size bombs (the first `count` of them, or all 21) through validate and train."""
    outcome = Outcome("input bombs", "YAML alias / nesting bombs, huge files and values, deep JSON")
    rng = random.Random(f"{seed}-bombs")
    with timed(outcome):
        placements = ("string value", "number value", "inside model.config", "override")
        cases = [alias_bomb(rng.choice((6, 8, 9)), rng.choice((9, 10)), p) for p in placements]
        cases += [alias_bomb(levels, 9, rng.choice(placements)) for levels in (6, 12, 30)]
        cases += [yaml_nesting(depth) for depth in (65, rng.randint(66, 400), rng.randint(600, 5000))]
        for key in ("model.config_path", "strategies.deepspeed_config"):
            cases += [json_nesting(key, depth) for depth in (65, rng.randint(66, 900), 100_000)]
        cases += size_bombs()
        run_cases(outcome, work, cases[:count])
    return outcome


# -------------------------------------------------------------------------------------- undecodable


def garbage(rng: random.Random, valid: bytes = b"", within: bytes = b"") -> bytes:
    """Bytes that are not UTF-8: a drawn bad sequence inserted at a drawn place of `valid` (inside the
    first `within` when given: a value, where a reader must decode it, not a key it would just rename)."""
    start = valid.find(within) if within else 0
    cut = start + rng.randrange((len(within) if within else len(valid)) + 1)
    return valid[:cut] + rng.choice(BAD_BYTES) + valid[cut:]


Use = Callable[[Path, Path], list[str]]  # (the case's directory, the bad file) -> the command's arguments
CORPUS = str(REPO / "data" / "tiny_corpus.txt")
TOKENIZER = REPO / "data" / "tiny-sft-tokenizer"


def bad_file(
    key: str, label: str, name: str, bad: bytes, use: Use, commands: tuple[str, ...] = COMMANDS
) -> Case:
    """`bad` written to `name` (under the case's directory); the error must name `key`."""

    def write(where: Path) -> list[str]:
        file = where / name
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_bytes(bad)
        return use(where, file)

    return Case(key, label, key, write, commands)


def named_by(section: str, field: str, **others: Any) -> Use:
    """A recipe whose `section.field` is the bad file (`others`: more keys of that section)."""
    return lambda where, file: [write_recipe(where, recipe(where, **{section: {**others, field: str(file)}}))]


def in_pretrained_dir(where: Path, file: Path) -> list[str]:
    """model.pretrained: the bad file's directory, completed with the files it lacks."""
    from safetensors.torch import save_file

    model = file.parent
    if not (model / "config.json").exists():
        (model / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 320}), encoding="utf-8")
    if not (model / "model.safetensors").exists():
        save_file({"lm_head.weight": torch.zeros(2, 2)}, str(model / "model.safetensors"))
    return named_by("model", "pretrained", config=None)(where, model)


def in_tokenizer_dir(where: Path, file: Path) -> list[str]:
    """data.tokenizer: the bad file's directory, completed with the shipped tokenizer's other files."""
    for other in TOKENIZER.iterdir():
        if not (file.parent / other.name).exists():
            shutil.copy(other, file.parent / other.name)
    return named_by("data", "tokenizer", source="text", path=CORPUS)(where, file.parent)


def with_flag(flag: str, suffix: str = "") -> Use:
    return lambda where, file: [write_recipe(where, recipe(where)), flag, f"{file}{suffix}"]


def undecodable_cases(rng: random.Random) -> list[Case]:
    """One case per path a recipe (or the command line) names, the bad bytes and their place drawn."""
    config = json.dumps(TINY_LLAMA).encode()
    rows = b'{"text": "one"}\n{"text": "two"}\n'
    cases = [
        Case("the recipe", "recipe.yaml not UTF-8", "UTF-8", lambda w: bad_recipe(w, rng)),
        bad_file(
            "model.config_path",
            "config.json",
            "config.json",
            garbage(rng, config),
            named_by("model", "config_path", config=None),
        ),
        bad_file("run.output_dir", "a file in its place", "run", garbage(rng), named_by("run", "output_dir")),
        bad_file(
            "--trainer",
            "FILE.py",
            "mine.py",
            garbage(rng, b"import memtrain\n"),
            with_flag("--trainer", ":Mine"),
        ),
        bad_file(
            "--gpu",
            "a GPU profile",
            "gpu.yaml",
            garbage(rng, (REPO / "configs/h100-80gb.yaml").read_bytes()),
            with_flag("--gpu"),
            ("plan",),
        ),
        bad_file(
            "strategies.deepspeed_config",
            "ds.json",
            "ds.json",
            garbage(rng, b'{"bf16": {}}'),
            named_by("strategies", "deepspeed_config", **DEEPSPEED),
            DEEPSPEED_COMMANDS,
        ),
        bad_file(
            "data.tokenizer",
            "a tokenizers JSON file",
            "tokenizer.json",
            garbage(rng, (TOKENIZER / "tokenizer.json").read_bytes()[:300]),
            named_by("data", "tokenizer", source="text", path=CORPUS),
        ),
    ]
    for name, valid in (
        ("config.json", config),
        ("model.safetensors.index.json", b'{"weight_map": {}}'),
        ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
    ):
        cases.append(
            bad_file("model.pretrained", name, f"model/{name}", garbage(rng, valid), in_pretrained_dir)
        )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        bad = garbage(rng, (TOKENIZER / name).read_bytes())
        cases.append(
            bad_file("data.tokenizer", f"a directory's {name}", f"tokenizer/{name}", bad, in_tokenizer_dir)
        )
    for source, name, valid in (
        ("text", "corpus.txt", b"one document\n\nanother one\n"),
        ("jsonl", "docs.jsonl", rows),
        ("dataset", "rows.jsonl", rows),
        ("dataset", "rows.json", b'[{"text": "one"}, {"text": "two"}]'),
        ("dataset", "rows.csv", b"text\none\ntwo\n"),
        ("dataset", "rows.parquet", b"PAR1 not parquet PAR1"),
        ("dataset", "rows.arrow", b"ARROW1 not arrow"),
    ):
        use = named_by("data", "path", source=source)
        bad = garbage(rng, valid, within=b"one" if b"one" in valid else b"")
        cases.append(bad_file("data.path", f"data.source {source}, {name}", name, bad, use))
    return cases


def bad_recipe(where: Path, rng: random.Random) -> list[str]:
    path = where / "recipe.yaml"
    path.write_bytes(garbage(rng, yaml.safe_dump(recipe(where)).encode()))
    return [str(path)]


def undecodable_files(work: Path, seed: int) -> Outcome:
    """Bytes that are not UTF-8 at every path a recipe names, through validate and train (plan for --gpu)."""
    outcome = Outcome("undecodable files", "bytes that are not UTF-8 at every path a recipe or flag names")
    with timed(outcome):
        cases = undecodable_cases(random.Random(f"{seed}-undecodable"))
        uncovered = [key for key in CausalLMRecipe.path_keys if key not in {c.kind for c in cases}]
        if uncovered:
            outcome.record(f"no case for {', '.join(uncovered)}", "coverage of CausalLMRecipe.path_keys")
        run_cases(outcome, work, cases)
    return outcome


# ------------------------------------------------------------------------------------------- inputs


def _data_case(label: str, name: str, content: Callable[[Path], None], source: str, expect: str) -> Case:
    """`data.path` (a file written by `content`) through `data.source`, with the shipped tokenizer."""

    def write(where: Path) -> list[str]:
        file = where / name
        content(file)
        data = {"source": source, "path": str(file), "tokenizer": str(TOKENIZER)}
        return [write_recipe(where, recipe(where, data=data))]

    return Case("inputs", label, expect, write)


def _deep_row(file: Path) -> None:
    file.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n", encoding="utf-8")


def _long_line(file: Path) -> None:
    """A 200 MB line, sparse on disk."""
    with file.open("wb") as handle:
        handle.write(b'{"text": "')
        handle.seek(200 * 2**20)
        handle.write(b'"}\n')


def _trainer_case(label: str, source: str, name: str) -> Case:
    def write(where: Path) -> list[str]:
        (where / name).write_text(source, encoding="utf-8")
        return [write_recipe(where, recipe(where)), "--trainer", f"{where / name}:T"]

    return Case("inputs", label, "--trainer", write)


def _relabelled_weights(where: Path) -> list[str]:
    """model.pretrained whose F32 tensors are relabelled I32 in the safetensors header."""
    from safetensors.torch import save_file

    model = where / "model"
    model.mkdir()
    config = {**TINY_LLAMA, "vocab_size": 320, "tie_word_embeddings": False}
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    from transformers import AutoConfig, AutoModelForCausalLM

    built = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    save_file({k: v.contiguous() for k, v in built.state_dict().items()}, str(model / "model.safetensors"))
    data = (model / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].replace(b'"F32"', b'"I32"')
    (model / "model.safetensors").write_bytes(data[:8] + header + data[8 + size :])
    return [write_recipe(where, recipe(where, model={"config": None, "pretrained": str(model)}))]


def _huge_config(where: Path) -> list[str]:
    """A 70B Llama config with a pinned plan: refused from its shapes before any weight is allocated."""
    config = {**TINY_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
    config.update({"num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256})
    strategies = {"precision": "fp32", "sharding": "none"}
    return [write_recipe(where, recipe(where, model={"config": config}, strategies=strategies))]


def input_cases() -> list[Case]:
    """The inputs that reached a traceback or a silent wrong result (docs/RELIABILITY.md, "Inputs")."""
    return [
        _data_case("jsonl row nested 100k deep", "deep.jsonl", _deep_row, "jsonl", "nested more than 64"),
        _data_case("the same through datasets", "deep.jsonl", _deep_row, "dataset", "nested more than 64"),
        _data_case("a 200 MB jsonl line", "long.jsonl", _long_line, "jsonl", "longer than 64 MiB"),
        _data_case("the same through datasets", "long.jsonl", _long_line, "dataset", "longer than 64 MiB"),
        _trainer_case("--trainer file calling sys.exit(0)", "import sys\nsys.exit(0)\n", "exits.py"),
        _trainer_case("--trainer x.yaml:T", "run: {}\n", "x.yaml"),
        Case(
            "inputs", "train.lr=1e300", "train.lr", lambda w: [write_recipe(w, recipe(w)), "train.lr=1e300"]
        ),
        Case("inputs", "F32 weights relabelled I32", "stored as I32", _relabelled_weights, ("train",)),
        Case("inputs", "a 70B config, plan pinned", "weights alone", _huge_config, ("train",)),
    ]


def inputs(work: Path, seed: int, count: int | None = None) -> Outcome:
    """The "inputs" probe class through validate and train (the first `count` cases, or all)."""
    outcome = Outcome(
        "inputs", "deep and long data rows, --trainer exits, lr overflow, relabelled weights, 70B"
    )
    with timed(outcome):
        run_cases(outcome, work, input_cases()[:count])
    return outcome
