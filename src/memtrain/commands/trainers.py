"""Which `Trainer` class a command runs: the built-in causal-LM trainer, or the user's subclass named by
`--trainer path/to/file.py:MyTrainer` or `--trainer package.module:MyTrainer`.

The file is the user's own training code, run as `python file.py` would run it (as torchrun runs a
script); it is imported once per process under a module name of its own, so every rank of a torchrun
launch loads the same class.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from memtrain.errors import MemtrainError
from memtrain.training.trainer import Trainer


def trainer_class(spec: str | None) -> type[Trainer]:
    """The class `spec` names (None: the built-in `CausalLMTrainer`); `MemtrainError` naming `--trainer`."""
    if spec is None:
        from memtrain.causal_lm.trainer import CausalLMTrainer

        return CausalLMTrainer
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise MemtrainError(
            f"--trainer: {spec!r} should be path/to/file.py:ClassName or package.module:ClassName"
        )
    module = _load_file(Path(where)) if where.endswith(".py") or "/" in where else _import(where)
    cls = getattr(module, name, None)
    if cls is None:
        raise MemtrainError(f"--trainer: {where} has no {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise MemtrainError(f"--trainer: {where}:{name} is not a subclass of memtrain.Trainer")
    return cls


def _load_file(path: Path) -> object:
    if not path.is_file():
        raise MemtrainError(f"--trainer: no file {path}")
    module_name = f"memtrain_user_{abs(hash(str(path.resolve())))}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[module_name]
        raise
    return module


def _import(name: str) -> object:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MemtrainError(f"--trainer: cannot import {name} ({exc})") from None
