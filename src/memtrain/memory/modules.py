"""Which module was running when memory peaked, in forward and in backward.

Forward: pre/post hooks on every module of the tracked model. Backward: a module's backward starts when the
gradient of one of its outputs is ready and ends when the gradient of one of its inputs is; plain tensor
hooks on those tensors mark both. The hooks hold nothing but a name, so the graph is freed as usual even
when backward fails half-way. (torch's ModTracker does the same job, but its multi-grad hooks keep
references to graph nodes: after a backward that raised, e.g. a simulated OOM, every saved activation stays
alive, which would defeat OOM recovery.) "Innermost" is the most recently entered module still active.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def graph_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Non-leaf tensors that require grad inside (nested) tuples, lists, dicts and ModelOutputs
    (a transformers ModelOutput is a Mapping)."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from graph_tensors(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from graph_tensors(v)


def is_compiled(module: nn.Module) -> bool:
    """Whether `nn.Module.compile()` compiled `module` (it leaves `_compiled_call_impl`): its call, hooks
    included, is one compiled region."""
    return getattr(module, "_compiled_call_impl", None) is not None


class ModuleAttribution:
    """Tracks the running module; `forward_depth > 0` while a module's forward runs (also recompute).
    Compiled modules (`is_compiled`) and what they hold are not tracked: they run as one region."""

    def __init__(self, model: nn.Module | None) -> None:
        self._model = model
        self._handles: list[RemovableHandle] = []
        self._active: dict[str, int] = {}  # module name -> when it was (last) entered
        self._order = itertools.count()
        self.forward_depth = 0

    def start(self) -> None:
        """Install the hooks (again) and forget any module left active by a step that raised."""
        self.stop()
        self._active.clear()
        self.forward_depth = 0
        if self._model is None:
            return
        compiled = [n for n, m in self._model.named_modules() if is_compiled(m)]
        for name, module in self._model.named_modules():
            if any(name == c or name.startswith(c + ".") or not c for c in compiled):
                continue  # its hooks would run inside the compiled region: dynamo would break the graph there
            name = name or type(self._model).__name__
            self._handles += [
                module.register_forward_pre_hook(partial(self._pre_forward, name), with_kwargs=True),
                module.register_forward_hook(
                    partial(self._post_forward, name), with_kwargs=True, always_call=True
                ),
            ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forget_backward(self) -> None:
        """Mark every module finished: a module whose inputs need no gradient (the embedding) never says so."""
        self._active.clear()

    def current(self) -> str:
        """The innermost running module's name relative to the model (the root is its class name), or ""."""
        return max(self._active, key=self._active.__getitem__) if self._active else ""

    def _enter(self, name: str, *_grad: object) -> None:
        self._active[name] = next(self._order)

    def _leave(self, name: str, *_grad: object) -> None:
        self._active.pop(name, None)

    def _pre_forward(
        self, name: str, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.forward_depth += 1
        self._enter(name)
        for t in graph_tensors((args, kwargs)):
            t.register_hook(
                partial(self._leave, name)
            )  # its input's gradient: this module's backward is done

    def _post_forward(
        self, name: str, _module: nn.Module, _args: tuple[Any, ...], _kwargs: dict[str, Any], output: Any
    ) -> None:
        self.forward_depth -= 1
        self._leave(name)
        for t in graph_tensors(output):
            t.register_hook(
                partial(self._enter, name)
            )  # its output's gradient: this module's backward starts
