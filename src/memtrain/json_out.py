"""Strict JSON for every file and report memtrain writes.

Why: Python's `json` writes NaN and Infinity by default, which is not JSON: `jq`, JavaScript, pandas'
strict readers and most dashboards reject the whole file. A non-finite number (a diverged loss, an
evaluation with no tokens) is written as `null`, and the dotted paths of the values replaced are listed
under the key `nonfinite` of the top-level object, so nothing is silently lost.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

NONFINITE_KEY = "nonfinite"


def finite_only(value: Any, path: str = "", replaced: list[str] | None = None) -> Any:
    """`value` with every NaN/inf float replaced by None; the dotted path of each goes to `replaced`."""
    if isinstance(value, float) and not math.isfinite(value):
        if replaced is not None:
            replaced.append(f"{path or '.'}={value}")
        return None
    if isinstance(value, dict):
        return {k: finite_only(v, f"{path}.{k}" if path else str(k), replaced) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(v, f"{path}[{i}]", replaced) for i, v in enumerate(value)]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps` that never writes NaN/Infinity (see the module docstring)."""
    replaced: list[str] = []
    clean = finite_only(value, "", replaced)
    if replaced and isinstance(clean, dict):
        clean[NONFINITE_KEY] = replaced
    return json.dumps(clean, allow_nan=False, **options)


def write_atomic(path: Path, data: Any) -> None:
    """Write `data` as indented, sorted strict JSON to `path` through a temporary file and a rename, so a
    reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)
