"""Reading the files a recipe points at (a model config.json, a DeepSpeed config, a safetensors index) with
errors that name the recipe key, so a bad path or a broken file reads as a recipe mistake (exit 2), not a
traceback.

Why bounded: these files come from anywhere (a download, a colleague, a generator gone wrong). A 5 GB file
would be read whole into memory, JSON nested thousands of levels deep makes `json.loads` raise
`RecursionError`, and nesting below that still makes every later recursive walk (deepcopy, merging,
hashing) slow or fragile. A config needs neither: the limits below are far above any real one.

memtrain's own files in a run directory (a checkpoint's meta.json, recipe.json) are input too: a shared run
directory may hold a FIFO (which would block resume while it holds the run's lock), /dev/zero behind a
symlink, or 50 MB of JSON. `read_regular_file` / `parse_json` read them bounded, never blocking, and say
why in a `FileRefused` the caller turns into its own one-line error.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from memtrain.errors import RecipeError

MAX_JSON_BYTES = 16 * 2**20  # a model config or a DeepSpeed config is kilobytes; a sharded index < 1 MiB
MAX_JSON_DEPTH = 64  # nesting levels of objects and arrays


class FileRefused(ValueError):
    """A file memtrain will not read (its message says why, without the path: the caller names it)."""


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of the regular file `path`, at most `limit`; `FileRefused` when it is a symlink (memtrain
    writes none), anything but a regular file (a FIFO is refused unread: it is opened without blocking),
    larger than `limit`, or unreadable. `FileNotFoundError` when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FileRefused("a symlink, and memtrain writes this file as a regular file") from None
        raise FileRefused(exc.strerror or str(exc)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory, a FIFO, a device
        os.close(fd)
        raise FileRefused("not a regular file")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(f"over {mib(limit)}, far more than memtrain writes there")
    return data


def parse_json(data: bytes) -> Any:
    """The JSON value of `data`; `FileRefused` when it is not UTF-8, not JSON or nested more than
    `MAX_JSON_DEPTH` levels."""
    too_deep = FileRefused(f"nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        loaded = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise FileRefused(f"not UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise FileRefused(f"not JSON ({exc.msg}, line {exc.lineno})") from None
    except RecursionError:
        raise too_deep from None
    if json_depth(loaded) > MAX_JSON_DEPTH:
        raise too_deep
    return loaded


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
