"""Traced sizes kept on disk between `memtrain plan` runs: a what-if asked again (another GPU count, another
global batch, another budget) reads the traces of the same model instead of tracing it again.

Why it is safe to reuse a trace: a traced size (activations.trace_step) is a function of the spec's hooks,
the size's strategies and rows, the adapters, the base quantisation and torch's thread count and default
dtype (model_probe.py, "Why traces can be shared"), run by this installation's code. The key holds all of
them: the trainer's `ModelSpec.trace_key` (a spec without one is never cached), each hook's code (its file's
bytes, name and line), the strategies as their classes and fields, the CPU's instruction set and the
PYTORCH_/TORCH_ settings of the environment (a cache shared between machines), every installed distribution's version
(torch, transformers, a kernel hub package that swaps a layer's forward) and the bytes of every memtrain
source file (any change to the planner, the tracker or a strategy makes new keys). A file is the key's
digest; the key itself is stored in it and compared whole on reading, so a digest collision, a stale
format or a truncated file is a miss, never a wrong trace.

Why JSON: a cache file is read back into a `StepTrace` field by field, each value checked for its type, so
a file planted in the cache can at worst be a trace of another model, never code (no pickle). Files are
written atomically (json_out), so a concurrent reader sees a whole file or none.

Where: `$MEMTRAIN_CACHE_DIR/traces/` (default `$XDG_CACHE_HOME/memtrain`, else `~/.cache/memtrain`, as
step_time.json); `MEMTRAIN_CACHE_DIR=off` turns it off (the test suite's default). A trace on real tensors
(trace_fallback.py) or under a patched fake-tensor mode is never cached (`ModelProbe._shared_key`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from memtrain import json_out
from memtrain.planner.activations import Segment, SegmentKey, StepTrace
from memtrain.planner.allocation_trace import PieceKey

CACHE_ENV = "MEMTRAIN_CACHE_DIR"
FORMAT = 1  # the layout of a cache file; a file of another format is a miss
MAX_FILE_BYTES = 256 * 2**20  # a deep clone's allocation log is megabytes
KEEP_FILES = 2000  # per kind; the least recently written beyond it are removed (an 8B what-if writes ~50)


def cache_dir() -> Path | None:
    """memtrain's cache directory; None when `MEMTRAIN_CACHE_DIR=off`."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured.lower() == "off":
        return None
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "memtrain"


def disk_key(
    trace_key: Hashable,
    hooks: tuple[Callable[..., object] | None, ...],
    size: tuple[object, ...],
    strategies: tuple[object, ...],
    threads: tuple[int, object],
) -> str | None:
    """The text a traced size is stored under: the spec's `trace_key`, its hooks' code (file, bytes, name,
    line), the traced `size` (`ModelProbe._trace`'s), the probe's adapters and base quantisation
    (`strategies`), torch's threads and default dtype, every installed distribution and memtrain's sources;
    None when a hook has no source file to stand for it."""
    identities = [_hook_text(hook) for hook in hooks]
    if any(text is None for text in identities):
        return None
    parts = [
        f"format {FORMAT}",
        f"trace_key {trace_key!r}",
        *(f"hook {text}" for text in identities),
        "size " + ", ".join(_value_text(v) for v in size),
        "strategies " + ", ".join(_value_text(v) for v in strategies),
        f"threads {threads!r}",
        f"machine {_machine()}",
        f"installed {_installed()}",
        f"memtrain {_sources()}",
    ]
    return "\n".join(parts)


def load(key: str) -> StepTrace | None:
    """The trace stored under `key`, or None (no cache, no file, another key, a file that does not read)."""
    path = _path(key)
    if path is None:
        return None
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        doc = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("key") != key:
            return None
        return _trace_from(doc["trace"])
    except (OSError, ValueError, KeyError, TypeError):  # unreadable or malformed: traced again, rewritten
        return None


def store(key: str, trace: StepTrace) -> None:
    """Keep `trace` under `key`; a cache that cannot be written is skipped (planning goes on)."""
    path = _path(key)
    if path is None:
        return
    _write(path, {"key": key, "trace": _trace_doc(trace)})


def load_numbers(key: str) -> list[int] | None:
    """Integers stored under `key` (`store_numbers`), or None: what a computation of pure inputs (the key
    holds them all, with memtrain's sources) gave before."""
    path = _path(key, "numbers")
    try:
        if path is None or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        doc = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("key") != key:
            return None
        return [_int(n) for n in doc["numbers"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_numbers(key: str, numbers: list[int]) -> None:
    """Keep `numbers` under `key` (`load_numbers`)."""
    path = _path(key, "numbers")
    if path is None:
        return
    _write(path, {"key": key, "numbers": numbers})


def numbers_key(*parts: object) -> str | None:
    """The key of a computation of `parts` by memtrain's code (None when the cache is off)."""
    if cache_dir() is None:
        return None
    return "\n".join([f"format {FORMAT}", *(repr(p) for p in parts), f"memtrain {_sources()}"])


def _write(path: Path, doc: dict[str, Any]) -> None:
    """`doc` to `path` atomically, then the oldest files of its directory beyond `KEEP_FILES` removed (every
    change of memtrain or of a distribution leaves the files of the old keys unread); failures skipped."""
    with contextlib.suppress(Exception):  # a full disk, a read-only home: the cache is an optimisation
        path.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_bytes_atomic(path, json.dumps(doc).encode())
        files = [f for f in path.parent.iterdir() if f.suffix == ".json"]
        if len(files) > KEEP_FILES:
            for old in sorted(files, key=lambda f: f.stat().st_mtime)[: len(files) - KEEP_FILES]:
                old.unlink(missing_ok=True)


def _path(key: str, kind: str = "traces") -> Path | None:
    root = cache_dir()
    return None if root is None else root / kind / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _hook_text(hook: Callable[..., object] | None) -> str | None:
    """A hook as its code's file (with a digest of the file's bytes), qualified name and first line."""
    if hook is None:
        return "none"
    function = getattr(hook, "__func__", hook)
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    owner = type(getattr(hook, "__self__", None))
    try:
        source = hashlib.sha256(Path(code.co_filename).read_bytes()).hexdigest()
    except OSError:
        return None
    return f"{code.co_filename}:{code.co_qualname}:{code.co_firstlineno} {source} {owner.__qualname__}"


def _value_text(value: object) -> str:
    """A strategy, dtype or number as text that names its class too (two classes may share a name)."""
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}:{value!r}"


def _machine() -> str:
    """What picks this process's CPU kernels (a cache directory shared between machines, an environment
    that selects another attention or allocator path): the CPU's instruction set torch dispatches for and
    the torch settings of the environment."""
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith(("PYTORCH_", "TORCH_")))
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} {settings!r}"


@functools.cache
def _installed() -> str:
    """Every installed distribution's metadata directory on the import path (its name holds the version:
    `torch-2.13.0.dist-info`), sorted: an upgrade of any makes new keys. Listed, not read (a venv holds
    hundreds: reading each one's metadata costs more than the plan it would save)."""
    found: set[str] = set()
    for entry in sys.path:
        with contextlib.suppress(OSError):
            found.update(n for n in os.listdir(entry or ".") if n.endswith((".dist-info", ".egg-info")))
    return ";".join(sorted(found))


@functools.cache
def _sources() -> str:
    """A digest of every file of the memtrain package."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _trace_doc(trace: StepTrace) -> dict[str, Any]:
    return {
        "tokens": trace.tokens,
        "depth": trace.depth,
        "segments": [
            [[k.micro_step, k.phase, k.block], [list(s.at_peak), list(s.maxima), list(s.end)]]
            for k, s in trace.segments.items()
        ],
        "attention": trace.attention,
        "reentered": trace.reentered,
        "no_grad": sorted([block, name] for block, name in trace.no_grad),
        "allocations": [
            [[k.micro_step, k.phase, k.block], [[sid, n] for sid, n in events]]
            for k, events in trace.allocations
        ],
        "gradient_allocations": sorted(trace.gradient_allocations),
    }


def _trace_from(doc: dict[str, Any]) -> StepTrace:
    """A `StepTrace` from its document, every value checked (`TypeError`/`ValueError` on anything else)."""
    segments = {}
    for key, (at_peak, maxima, end) in doc["segments"]:
        segments[SegmentKey(_str(key[0]), _str(key[1]), _int(key[2]))] = Segment(
            _vec(at_peak), _vec(maxima), _vec(end)
        )
    allocations = tuple(
        (
            PieceKey(_str(key[0]), _str(key[1]), _int(key[2])),
            tuple((_int(sid), _int(n)) for sid, n in events),
        )
        for key, events in doc["allocations"]
    )
    return StepTrace(
        tokens=_int(doc["tokens"]),
        depth=_int(doc["depth"]),
        segments=segments,
        attention=_str(doc["attention"]),
        reentered=_bool(doc["reentered"]),
        no_grad=frozenset((_int(block), _str(name)) for block, name in doc["no_grad"]),
        allocations=allocations,
        gradient_allocations=frozenset(_int(sid) for sid in doc["gradient_allocations"]),
    )


def _int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, found {type(value).__name__}")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, found {type(value).__name__}")
    return value


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, found {type(value).__name__}")
    return value


def _vec(values: object) -> tuple[float, ...]:
    if not isinstance(values, list) or not all(type(v) in (int, float) for v in values):
        raise TypeError("expected a list of numbers")
    return tuple(float(v) for v in values)
