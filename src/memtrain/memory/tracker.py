"""MemoryTracker: every live storage byte of a training step, by component, phase and module.

Why a dispatch mode: it sees every aten op's outputs below autograd, in forward, backward (also on the
autograd worker threads, which inherit the mode) and the optimizer, without touching the model, so it
measures what really exists rather than what a formula predicts. Allocations are counted when an op returns
a new storage; frees when the storage's Python object dies (see ledger.py). Only whole op outputs are seen:
workspaces inside a kernel and allocator rounding/caching are not (cuda_stats.py reports those).

Components are decided by *current identity*: parameters are weights, `p.grad` are gradients, tensors in
`optimizer.state` are optimizer states — re-derived at phase boundaries, after each gradient accumulation
(post-accumulate-grad hooks) and at new peaks while the optimizer runs (its state appears lazily there).
Anything else created while a forward runs (the forward phase, or a module forward, e.g. recompute) is an
activation while it lives; the rest is `other`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._torch_private import TorchDispatchMode
from .budget import Budget
from .first_step import explain_first_step
from .ledger import AllocationLog, StorageLedger, storages_of, tensors_in
from .modules import ModuleAttribution
from .storage_resize import listen, unlisten
from .timeline import Timeline
from .values import PHASES, StepMemory


class _Watch(TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self._tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _uncounted.depth:
            self._tracker._uncounted_op(out)
        else:
            self._tracker._after_op(args, kwargs, out)
        return out


class _Uncounted(threading.local):
    depth = 0


_uncounted = _Uncounted()


@contextmanager
def uncounted() -> Iterator[None]:
    """What ops make inside is not counted (a storage first seen later is counted from then): buffers a
    compiler would not allocate, run here only to carry on the program (planner/compiled_trace.py)."""
    _uncounted.depth += 1
    try:
        yield
    finally:
        _uncounted.depth -= 1


class _InfraWatch(_Watch):
    """The same count, declared an infrastructure mode (as fake tensors are): dynamo compiles and runs
    compiled regions under it instead of running them eagerly. Only the planner's trace wants this: its
    compiled regions run op by op (planner/compiled_trace.py), so every op is still seen."""

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True


class MemoryTracker:
    """Attributes live storage bytes to weights / gradients / optimizer_states / activations / other.

    ``with tracker:`` starts counting (pre-existing parameters, buffers, gradients and optimizer state
    included); ``begin_step`` / ``phase`` / ``end_step`` delimit what a step report covers. With
    ``budget_bytes`` the allocation that would take live bytes past it raises ``torch.OutOfMemoryError``.
    Only storages on ``device`` count (default: the device of the model's first parameter, else CPU), and,
    with ``host``, real host (CPU) storages too: a fake model's trace of a CPU run, whose real batch is in
    the memory the run's device is (`memtrain.training.rank_trace`). ``timeline=False`` draws no timeline
    samples, for a reader of the step reports alone (the planner's traces: about a tenth of their time).
    `compiled_regions`: let dynamo run compiled regions under the tracker (see `_InfraWatch`); without it
    they run eagerly.
    """

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: torch.optim.Optimizer | None = None,
        budget_bytes: int | None = None,
        *,
        device: torch.device | str | None = None,
        host: bool = False,
        samples_per_step: int = 2000,
        timeline_steps: int = 8,
        timeline: bool = True,
        compiled_regions: bool = False,
    ) -> None:
        self.model = model
        # The parameters the model holds now: FSDP2 swaps gathered (unsharded) tensors in as a module's
        # parameters between its all-gather and its reshard, and its sharded ones are still the weights.
        self._held: dict[int, torch.Tensor] = (
            {id(p): p for p in model.parameters()} if model is not None else {}
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.device = torch.device(device) if device is not None else _default_device(model)
        self.budget = Budget(budget_bytes) if budget_bytes is not None else None
        self.reports: list[StepMemory] = []
        self.timeline = Timeline(samples_per_step, timeline_steps)
        self._sampled = timeline  # False: no samples are drawn (a reader of the step reports alone)
        self._ledger = StorageLedger(self.device, self.budget, host)
        self._modules = ModuleAttribution(model)
        self._mode: _Watch | None = None
        self._watch = _InfraWatch if compiled_regions else _Watch
        self._handles: list[RemovableHandle] = []
        self._params: list[torch.Tensor] = []
        self._frozen: list[nn.Module] = []
        self._masters: list[torch.Tensor] = []
        self._phase = "other"
        self._optimizer_running = False
        self._step: int | None = None
        if optimizer is not None:
            self.attach_optimizer(optimizer)

    # ----------------------------------------------------------------------------------- public API

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Count `optimizer`'s state from now on (it is usually built after the model)."""
        self.optimizer = optimizer
        if self._mode is not None:
            self._handles += self._optimizer_hooks(optimizer)
            self._resync()

    def count_as_weights(self, module: nn.Module) -> None:
        """Count `module`'s parameters as weights too: a frozen model the step uses beside the trained one
        (DPO's reference copy). Call before `with tracker:`."""
        self._frozen.append(module)

    def __enter__(self) -> MemoryTracker:
        if self._mode is not None:
            raise RuntimeError("MemoryTracker is already active; nested `with tracker:` is not supported")
        self._refresh_params()
        for t in self._existing_tensors():
            for st in storages_of(t):
                self._ledger.observe(st, "other", allocation=False)
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params if p.requires_grad
        ]
        if self.optimizer is not None:
            self._handles += self._optimizer_hooks(self.optimizer)
        self._modules.start()
        self._resync()
        self._mode = self._watch(self)
        self._mode.__enter__()
        listen(self._ledger.resized)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._mode is not None
        unlisten(self._ledger.resized)
        self._mode.__exit__(exc_type, exc, tb)
        self._mode = None
        self._modules.stop()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def begin_step(self, step: int) -> None:
        """Start a step report; a step left open by an exception (an OOM) is simply discarded."""
        if self._mode is None:
            raise RuntimeError("begin_step() needs an active tracker: call it inside `with tracker:`")
        if self._step is not None:  # the previous step never ended (an exception): reset module tracking
            self._modules.start()
        self._modules.forget_backward()
        self._refresh_params()
        self._resync()
        self._step = step
        live = self._ledger.live
        self._peak = live
        self._at_peak = dict(self._ledger.bytes)
        self._peak_phase = self._phase
        self._peak_module = ""
        self._phase_peaks = {self._phase: live}
        self._component_peaks = dict(self._ledger.bytes)
        self._growth: dict[str, dict[str, int]] = {}
        self._growth_mark = dict(self._ledger.bytes)
        self.timeline.begin_step(self._ledger.clock, step)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute what happens inside to phase `name` (one of PHASES)."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {', '.join(PHASES)}")
        previous = self._phase
        self._switch_phase(name)
        try:
            yield
        finally:
            self._switch_phase(previous)

    def end_step(self) -> StepMemory:
        """Close the step begun by `begin_step` and return (and keep in `reports`) its record."""
        if self._step is None:
            raise RuntimeError("end_step() without begin_step()")
        self._resync()
        self._note_live(keep_sample=True)
        self._note_growth()
        report = StepMemory(
            step=self._step,
            peak_bytes=self._peak,
            at_peak=self._at_peak,
            peak_phase=self._peak_phase,
            peak_module=self._peak_module,
            phase_peaks=self._phase_peaks,
            live_bytes_end=self._ledger.live,
            phase_growth=self._growth,
            component_peaks=self._component_peaks,
        )
        self.reports.append(report)
        self._step = None
        return report

    def snapshot(self) -> dict[str, int]:
        """Live bytes per component right now (identities re-derived first)."""
        self._resync()
        return dict(self._ledger.bytes)

    @property
    def live_bytes(self) -> int:
        self._ledger.drain()
        return self._ledger.live

    def record_allocations(self) -> AllocationLog:
        """Log, from now on, every storage counted (serial, bytes) and released (serial, 0), in the order
        the live count changes (views and saved tensors share their storage: one entry), and which were
        gradients. It fills as the tracker runs; `memory.caching_allocator.replay` turns its events into
        reserved bytes."""
        self._ledger.log = AllocationLog()
        return self._ledger.log

    def first_step_report(self, device_peaks: Sequence[int] | None = None) -> dict[str, Any]:
        """Step 1's peak against the steady state (median of later steps), with the reasons from the data.

        `device_peaks` (optional, one per report, e.g. from cheap.StepPeak) adds the allocator's view:
        on CUDA the first step also pays for allocator warm-up, which storage counting cannot see.
        """
        return explain_first_step(self.reports, device_peaks)

    # ----------------------------------------------------------------------------------- internals

    def _after_op(self, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        ledger = self._ledger
        ledger.drain()
        for t in tensors_in((*args, *kwargs.values())):  # tensors made outside the mode (torch.tensor, data)
            for st in storages_of(t):
                ledger.observe(st, "other", allocation=False)
        origin = "activations" if self._phase == "forward" or self._modules.forward_depth > 0 else "other"
        for t in tensors_in(out if isinstance(out, (list, tuple)) else (out,)):
            for st in storages_of(t):
                ledger.observe(st, origin, allocation=True)
        ledger.clock += 1
        self._note_live()

    def _uncounted_op(self, out: Any) -> None:
        self._ledger.drain()
        for t in tensors_in(out if isinstance(out, (list, tuple)) else (out,)):
            for st in storages_of(t):
                self._ledger.uncounted(st)

    def _note_live(self, keep_sample: bool = False) -> None:
        if self._step is None:
            return
        live = self._ledger.live
        if live > self._peak:
            if self._optimizer_running or self._phase == "optimizer":
                self._resync()  # optimizer state is created lazily inside step()
                live = self._ledger.live
            self._peak = live
            self._at_peak = dict(self._ledger.bytes)
            self._peak_phase = self._phase
            self._peak_module = self._modules.current()
        if live > self._phase_peaks.get(self._phase, -1):
            self._phase_peaks[self._phase] = live
        for component, n in self._ledger.bytes.items():
            if n > self._component_peaks[component]:
                self._component_peaks[component] = n
        if self._sampled:
            self.timeline.add(self._ledger.clock, self._phase, self._ledger.bytes, live, keep_sample)

    def _switch_phase(self, name: str) -> None:
        self._modules.forget_backward()
        self._refresh_params()
        self._resync()
        if self._step is not None:
            self._note_growth()
            self.timeline.mark_phase(self._ledger.clock, name)
        self._phase = name
        self._note_live(keep_sample=True)

    def _note_growth(self) -> None:
        now = self._ledger.bytes
        growth = self._growth.setdefault(self._phase, dict.fromkeys(now, 0))
        for component, n in now.items():
            growth[component] += n - self._growth_mark[component]
        self._growth_mark = dict(now)

    def _resync(self) -> None:
        self._ledger.drain()
        grads = [p.grad for p in [*self._params, *self._masters] if p.grad is not None]
        self._ledger.classify(
            [
                ("weights", self._params),
                ("gradients", grads),
                ("optimizer_states", [*self._masters, *self._optimizer_tensors()]),
            ]
        )
        self._redraw_moves()

    def _on_grad(self, param: torch.Tensor) -> None:
        self._ledger.drain()
        if param.grad is not None:
            self._ledger.assign([param.grad], "gradients")
            self._redraw_moves()

    def _redraw_moves(self) -> None:
        # Optimizer state is recognised only once it is stored in optimizer.state; draw it as such from birth.
        if self._ledger.first_moves:
            self.timeline.reclassify(self._ledger.first_moves)
            self._ledger.first_moves.clear()

    def _optimizer_hooks(self, optimizer: torch.optim.Optimizer) -> list[RemovableHandle]:
        def pre(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            self._optimizer_running = True
            self._modules.forget_backward()

        def post(_opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            self._optimizer_running = False
            self._resync()

        return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]

    def _refresh_params(self) -> None:
        """Model parameters are weights. Parameters the optimizer steps that the model does not hold are
        master copies (fp32 masters of bf16 weights): optimizer states, as the ZeRO accounting has it."""
        seen: dict[int, torch.Tensor] = dict(self._held)
        if self.model is not None:
            seen.update((id(p), p) for p in self.model.parameters())
        for module in self._frozen:
            seen.update((id(p), p) for p in module.parameters())
        masters: dict[int, torch.Tensor] = {}
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    if self.model is None:
                        seen.setdefault(id(p), p)
                    elif id(p) not in seen:
                        masters[id(p)] = p
        self._params = list(seen.values())
        self._masters = list(masters.values())

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            v
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]

    def _existing_tensors(self) -> list[torch.Tensor]:
        buffers = list(self.model.buffers()) if self.model is not None else []
        grads = [p.grad for p in self._params if p.grad is not None]
        return [*self._params, *buffers, *grads, *self._optimizer_tensors()]


class SimulatedBudget(MemoryTracker):
    """Just the budget: ``with SimulatedBudget(n):`` raises ``torch.OutOfMemoryError`` past n live bytes."""

    def __init__(self, budget_bytes: int, device: torch.device | str = "cpu") -> None:
        super().__init__(None, budget_bytes=budget_bytes, device=device)


def _default_device(model: nn.Module | None) -> torch.device:
    # the storage's device, not the tensor's: under FakeTensorMode a "cuda" parameter's storage is on meta
    first = next(model.parameters(), None) if model is not None else None
    storages = storages_of(first) if first is not None else []
    return storages[0].device if storages else torch.device("cpu")
