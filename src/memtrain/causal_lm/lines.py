"""Line-oriented data files (text, jsonl, and the json files handed to `datasets`) read with bounds.

Why: `data.path` comes from anywhere. A jsonl row nested 100,000 levels deep made `json.loads` raise
`RecursionError` (a traceback), and the same row handed to `datasets` crashed the process inside pyarrow's
native JSON parser (SIGSEGV, no message at all). A 200 MB line was read whole, decoded and parsed before
anything looked at it. Here a line is read with `readline(limit + 1)`, so a line over `MAX_LINE_BYTES` is
refused after reading at most that much, and a line's nesting is measured before any parser sees it:
counting brackets is C-speed (`bytes.count`), and only a line with more brackets than `MAX_DEPTH` has its
strings removed and its depth walked. Both bounds are far above any real record (a chat record nests
about 3 levels; a long-context document is a few MB).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from memtrain.errors import RecipeError
from memtrain.jsonfile import MAX_JSON_DEPTH, mib

MAX_LINE_BYTES = 64 * 2**20  # one record (a jsonl line) or one line of a text corpus
MAX_DEPTH = MAX_JSON_DEPTH  # nesting levels of objects and arrays in one record
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # a JSON string (strings cannot hold a raw newline)
_BRACKET = re.compile(rb"[\[\]{}]")


def read_lines(path: Path, key: str, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """Each line of the file `path` (newline kept) with its 1-based number; `RecipeError` naming `key` and
    the line when one is longer than `limit` bytes (read no further than that), or the file cannot be read."""
    try:
        with path.open("rb") as handle:
            number = 0
            while line := handle.readline(limit + 1):
                number += 1
                if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
                    raise RecipeError(
                        [
                            f"{key}: {path}:{number} is a line longer than {mib(limit)}, the limit for one "
                            "record or line; split it"
                        ]
                    )
                yield number, line
    except OSError as exc:  # unreadable, a directory, a name the filesystem refuses
        raise RecipeError([f"{key}: cannot read {path} ({exc.strerror or exc})"]) from None


def too_deep(line: bytes, depth: int = 0, limit: int = MAX_DEPTH) -> tuple[bool, int]:
    """Whether the JSON text `line`, entered `depth` levels deep, nests deeper than `limit` levels, and
    the depth after it (for a JSON document spread over lines)."""
    text = _STRING.sub(b"", line)
    if depth + text.count(b"[") + text.count(b"{") <= limit:
        return False, depth + text.count(b"[") + text.count(b"{") - text.count(b"]") - text.count(b"}")
    for bracket in _BRACKET.findall(text):
        depth += 1 if bracket in b"[{" else -1
        if depth > limit:
            return True, depth
    return False, depth


def record_too_deep(line: bytes) -> bool:
    """Whether the one JSON record `line` nests deeper than `MAX_DEPTH` levels (a walk only when it holds
    more brackets than that)."""
    return line.count(b"[") + line.count(b"{") > MAX_DEPTH and too_deep(line)[0]


def check_json_lines(path: Path, key: str, one_per_line: bool) -> None:
    """`RecipeError` naming `key` and the line when a line of the JSON file `path` is too long (jsonl:
    `one_per_line`) or the JSON nests deeper than `MAX_DEPTH` (a .json document: across its lines)."""
    depth = 0
    for number, line in read_lines(path, key, MAX_LINE_BYTES if one_per_line else 2**62):
        deep, depth = (record_too_deep(line), 0) if one_per_line else too_deep(line, depth)
        if deep:
            raise RecipeError([nested_too_deeply(key, f"{path}:{number}")])


def nested_too_deeply(key: str, where: str) -> str:
    return f"{key}: {where} is nested more than {MAX_DEPTH} levels deep (a record needs a few)"
