"""What gloo's collectives hold in memory that torch's fake process group does not: for a rank trace whose
run would use gloo (a CPU run: `memtrain.distributed.collective_backend`).

The fake process group completes every collective at once and allocates nothing, so a traced step holds only
what the caller allocates. A gloo run holds more, each measured by the tracker on real gloo runs
(tests/parallel/test_rank_trace.py, docs/BENCHMARKS.md):

- a copy of every reduce-scatter's input. gloo has no reduce-scatter: `ProcessGroupGloo::_reduce_scatter_base`
  (and the coalesced one) clones each input, all-reduces the clone and copies this rank's chunk of it into the
  output when the work is waited on; the clone dies with the work. For FSDP2's gradient reduce-scatter that is
  the whole unsharded gradient of a layer group in the reduce dtype, live beside its input and output: the
  HSDP bf16 step peaks there, and its trace was 7% under without it;
- the tensors of a finished asynchronous collective (tensor parallelism's functional ones, waited on by
  `wait_tensor`), a while after the wait returned: gloo's worker thread holds the work (and so its tensors)
  until it is scheduled again after completing it, and the waiting thread may run ahead meanwhile. The
  all-reduce of the lm_head's input gradient (TP without sequence parallelism) was alive through the final
  norm's backward in some runs and not in others (1% of the step's peak). The trace holds such a collective's
  tensors until this rank issues its next collective: deterministic where the run's timing is not, and an
  upper bound for every run measured;
- by the same worker thread, a backward's all-gather's input and output (FSDP2's, c10d's, waited on by FSDP2
  before it copies the parameters out): under 1F1B x FSDP 2, the first stage peaked in the forward after a
  backward with that backward's all-gather buffers still alive in one run of two (337,284 B, against 328,172
  B on the last stage, the busiest otherwise), so they are held until the next collective too. A forward's
  all-gathers are not: held so, the last layer's lives through the loss, which no run measured (HSDP fp32
  without recompute 4.8% over; 2.9% with the backward's held). Other c10d collectives are not held either:
  none was measured alive past its wait;
- the input of expert parallelism's all-to-all of rows (`all_to_all_single`, waited on before it returns),
  by the same worker thread: the experts' outputs sent back (the rows this rank's experts received) were alive
  through the unpermuting and weighting after it in some 4-rank runs and not in others (a tiny MoE's peak
  +3.4% there: tests/parallel/test_expert_parallel.py), so it is held until the next collective too;
- the tensor of a point-to-point send (a pipeline stage's output or input gradient), for as long as the
  caller keeps the send's `Work`: gloo's work refers to it, and torch's 1F1B schedule keeps a warm-up send's
  works in a variable through its whole steady phase, so a first stage's output lives on there after its
  backward (one hidden state more at that stage's peak, which the fake group's work, holding nothing, missed).
  The trace ties the tensor to the caller's `Work` object, so it dies with it, as in the run.

All are gloo's own (NCCL reduce-scatters without copying the input; whether its work outlives a wait is
not measured here, with no GPU), so only a trace of a gloo run enters this mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._torch_private import TorchDispatchMode, in_backward, tree_leaves

ASYNC_NAMESPACE = "_c10d_functional"  # collectives waited on apart (`wait_tensor`): tensor parallelism's
COLLECTIVE_NAMESPACES = ("c10d", ASYNC_NAMESPACE)  # c10d's are waited on before they return: FSDP2's
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")  # in those namespaces, but nothing is sent
# c10d's, waited on before they return (FSDP2's): (outputs, inputs, ...)
SYNC_REDUCE_SCATTERS = ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")
# functional ones, waited on by `wait_tensor` of their outputs (tensor parallelism's): (inputs, ...) -> outputs
ASYNC_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced")
COPYING_ALL_REDUCES = ("all_reduce", "all_reduce_coalesced")  # functional: gloo reduces a copy, the output
SYNC_ALL_GATHERS = ("_allgather_base_", "allgather_into_tensor_coalesced_")  # FSDP2's: (outputs, inputs, ...)
ALL_TO_ALL = (
    "alltoall_base_"  # c10d's all_to_all_single (expert parallelism's dispatch): (output, input, ...)
)
SEND = "send"  # c10d's point-to-point send: (tensors, group, peer, tag) -> its work


class GlooBuffers(TorchDispatchMode):
    """While open (entered after a `MemoryTracker`, so that it counts them): the copies gloo makes of a
    reduce-scatter's inputs, alive until the reduce-scatter is waited on, an asynchronous collective's
    tensors and a backward's all-gather's buffers, alive until the next collective is issued, and a send's
    tensor, alive while the caller keeps its work (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._finished: list[torch.Tensor] = []  # the latest async collective's tensors: gloo's thread's
        # an async reduce-scatter's output (by storage) -> the output and gloo's copies, until its wait
        self._in_flight: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        # a send's work (the caller's object) -> its tensors; the latest one held here until the caller has it
        self._sends: weakref.WeakKeyDictionary[dist.Work, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        self._handing: dist.Work | None = None

    def __torch_dispatch__(
        self, func: Any, types: Sequence[type], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self._handing = None  # the send before this op has returned its work to the caller
        name = func.__name__.split(".")[0]
        if getattr(func, "namespace", None) not in COLLECTIVE_NAMESPACES:
            return func(*args, **kwargs)
        if name == "wait_tensor":
            _, copies = self._in_flight.pop(_key(args[0]), (None, []))
            self._finished += copies
        if name in NOT_COLLECTIVES:
            return func(*args, **kwargs)
        return self._collective(func, name, args, kwargs)

    def _collective(self, func: Any, name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        """Issue `func` with gloo's copies of a reduce-scatter's inputs alive; keep what an asynchronous
        collective's or a backward's all-gather's work holds (and the copies, until its wait) after it, and a send's
        tensors with its work."""
        self._finished = []  # gloo's thread has let go of the previous works by now
        copies = _reduce_scatter_copies(name, args)
        out = func(*args, **kwargs)
        if name == SEND:
            # the op returns the work boxed; pybind hands the caller this wrapper of it while one is alive
            self._handing = dist.Work.unbox(out)
            self._sends[self._handing] = _tensors(args[0])
        if name in SYNC_ALL_GATHERS and in_backward():
            self._finished += _tensors(args[:2])
        if name == ALL_TO_ALL and args[0].dim() > 1:  # the rows' exchange (not the counts'): its input
            self._finished += _tensors(args[1:2])
        if func.namespace != ASYNC_NAMESPACE:
            return out  # waited on before it returned: gloo's copies die here
        if name in ASYNC_REDUCE_SCATTERS:
            outputs = out if isinstance(out, (list, tuple)) else [out]
            self._in_flight.update((_key(o), (o, copies)) for o in outputs)
            copies = []
        self._finished += [*_held_by_work(name, args, out), *copies]
        return out


def _reduce_scatter_copies(name: str, args: Sequence[Any]) -> list[torch.Tensor]:
    """gloo's clones of a reduce-scatter's inputs (empty for any other collective)."""
    if name in SYNC_REDUCE_SCATTERS:
        inputs = args[1]
    elif name in ASYNC_REDUCE_SCATTERS:
        inputs = args[0]
    else:
        return []
    return [t.clone() for t in _tensors(inputs)]


def _held_by_work(name: str, args: Sequence[Any], out: Any) -> list[torch.Tensor]:
    """The tensors gloo's work of an asynchronous collective refers to: its inputs and outputs, but not the
    input of a reduce-scatter or of an all-reduce, which gloo (or the functional op) copies first."""
    if name in ASYNC_REDUCE_SCATTERS or name in COPYING_ALL_REDUCES:
        return _tensors(out)
    return _tensors((args, out))


def _key(tensor: torch.Tensor) -> int:
    """A tensor's storage, by identity (a wait may get another tensor object of the same output)."""
    return id(tensor.untyped_storage())


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result, at any depth (lists of tensors: the coalesced ops)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
