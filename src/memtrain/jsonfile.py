"""Reading the JSON files a recipe points at (a model config.json, a DeepSpeed config) with errors that
name the recipe key, so a bad path or a broken file reads as a recipe mistake (exit 2), not a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memtrain.errors import RecipeError


def read_json_object(path: str, key: str) -> dict[str, Any]:
    """The JSON object in `path`; `RecipeError` naming `key` when missing, invalid or not an object."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError([f"{key}: file not found: {file}"])
    try:
        loaded = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RecipeError([f"{key}: {file} is not valid JSON ({exc.msg}, line {exc.lineno})"]) from None
    if not isinstance(loaded, dict):
        raise RecipeError([f"{key}: {file} must hold a JSON object"])
    return loaded
