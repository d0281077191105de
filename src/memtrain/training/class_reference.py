"""How another process finds a trainer class: `package.module:Class`, or `path/to/file.py:Class`.

Why: the planner's rank trace (`memtrain.planner.rank_trace`) runs the trainer's own step in a process of its
own (torch's fake process group is process-global), which must build the same trainer from the same recipe.
`--trainer` already reads both forms (`memtrain.commands.trainers.trainer_class`); this writes them. A class
the user's file defined (`--trainer file.py:C` imports it under a name of its own) or a script's `__main__`
is named by its file; a class inside a function cannot be found again (None).
"""

from __future__ import annotations

import sys
from pathlib import Path

FILE_MODULES = ("memtrain_user_", "__main__")
"""Module names (prefixes) of classes a new process cannot import by name: loaded from a file."""


def class_reference(cls: type) -> str | None:
    """`cls` as `trainer_class` reads it, or None when a new process could not find it."""
    name, module = cls.__qualname__, cls.__module__
    if "<locals>" in name:
        return None
    if not module.startswith(FILE_MODULES):
        return f"{module}:{name}"
    path = getattr(sys.modules.get(module), "__file__", None)
    return f"{Path(path).resolve()}:{name}" if path else None
