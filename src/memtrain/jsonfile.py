"""Reading the files a recipe points at (a model config.json, a DeepSpeed config, a safetensors index) with
errors that name the recipe key, so a bad path or a broken file reads as a recipe mistake (exit 2), not a
traceback.

Why bounded: these files come from anywhere (a download, a colleague, a generator gone wrong). A 5 GB file
would be read whole into memory, JSON nested thousands of levels deep makes `json.loads` raise
`RecursionError`, and nesting below that still makes every later recursive walk (deepcopy, merging,
hashing) slow or fragile. A config needs neither: the limits below are far above any real one.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from memtrain.errors import RecipeError

MAX_JSON_BYTES = 16 * 2**20  # a model config or a DeepSpeed config is kilobytes; a sharded index < 1 MiB
MAX_JSON_DEPTH = 64  # nesting levels of objects and arrays


def read_json_object(path: str, key: str) -> dict[str, Any]:
    """The JSON object in `path`; `RecipeError` naming `key` when missing, too large, not UTF-8, invalid,
    nested too deeply or not an object."""
    text = read_text(path, key, MAX_JSON_BYTES)
    file = Path(path)
    too_deep = RecipeError([f"{key}: {file} is nested more than {MAX_JSON_DEPTH} levels deep"])
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecipeError([f"{key}: {file} is not valid JSON ({exc.msg}, line {exc.lineno})"]) from None
    except RecursionError:  # the parser's own limit (about 1000 levels)
        raise too_deep from None
    if json_depth(loaded) > MAX_JSON_DEPTH:
        raise too_deep
    if not isinstance(loaded, dict):
        raise RecipeError([f"{key}: {file} must hold a JSON object"])
    return loaded


def read_text(path: str | Path, key: str, limit: int) -> str:
    """The UTF-8 text of the file `path`; `RecipeError` naming `key` when it is missing, larger than
    `limit` bytes or not UTF-8 (with the line of the first bad byte)."""
    return decode_utf8(read_bytes(path, key, limit), path, key)


def decode_utf8(data: bytes, path: str | Path, key: str) -> str:
    """`data` (the bytes of the file `path`) as text; `RecipeError` naming `key` and the line of the first
    byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise RecipeError(
            [f"{key}: {path} is not UTF-8 text (byte {exc.start}, line {line}); save it as UTF-8"]
        ) from None


def read_bytes(path: str | Path, key: str, limit: int) -> bytes:
    """The bytes of the file `path`; `RecipeError` naming `key` when it is missing or larger than `limit`."""
    file = Path(path)
    try:
        size = file.stat().st_size if file.is_file() else None
        if size is not None and size <= limit:
            return file.read_bytes()
    except OSError as exc:  # unreadable, or a name the filesystem refuses
        raise RecipeError([f"{key}: cannot read {file} ({exc.strerror or exc})"]) from None
    if size is None:
        raise RecipeError([f"{key}: file not found: {file}"])
    raise RecipeError([f"{key}: {file} is {size:,} bytes, over the limit of {mib(limit)} for this file"])


def check_utf8(path: Path, key: str, chunk_bytes: int = 2**20) -> None:
    """`RecipeError` naming `key` and the line unless the file `path` is UTF-8 text; reads it in chunks, so
    a file larger than memory can be checked."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0  # bytes and newlines before the pending bytes of the decoder
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_bytes), b""):
            data = decoder.getstate()[0] + chunk
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line = lines + data.count(b"\n", 0, exc.start) + 1
                raise RecipeError(
                    [
                        f"{key}: {path} is not UTF-8 text (byte {offset + exc.start}, line {line}); save it as UTF-8"
                    ]
                ) from None
            pending = len(decoder.getstate()[0])
            offset, lines = offset + len(data) - pending, lines + data.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise RecipeError([f"{key}: {path} is not UTF-8 text (it ends inside a character)"]) from None


def mib(size: int) -> str:
    """`size` in MiB for messages about limits ("16 MiB")."""
    return f"{size / 2**20:g} MiB"


def json_depth(value: Any) -> int:
    """Levels of nested objects and arrays in a loaded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest
