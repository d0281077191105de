"""Compiled modules in the planner's fake-tensor trace: the program torch.compile runs, on fake tensors.

Why not the eager trace: a compiled module keeps what AOTAutograd's min-cut partitioner saves for its
backward (after Inductor's decompositions), not what eager autograd saves, and its temporaries are
Inductor's buffers. Inductor's generated code cannot run on fake tensors (it is C++ over real buffers),
but the program it compiles can: `aot_eager_decomp_partition` is dynamo's graph through the same
decompositions and the same partitioner, each op then run eagerly. So in a trace every compiled module
(`memory.modules.is_compiled`: what `nn.Module.compile()` leaves, whoever compiled it, the strategy or the
trainer's `build_model`) is compiled again with that backend, and the tracker counts the compiled
program's saved tensors exactly.

Inductor's fusion: it computes chains of pointwise ops inside one kernel, so their intermediates never
exist. The partitioned graphs run here node by node (their inputs freed after their last use, as Inductor's
code frees them), and a value Inductor would not allocate (`materialized`: a pointwise value read only by
pointwise ops, views and reductions, and no graph output) is computed `uncounted`. A checkpointed compiled
block also keeps two RNG states (`_holding_rng_states`), which no op makes. Measured against the
allocator's count of the Inductor step (`memory.host_allocations`) in tests/planner/test_compiled_peak.py.

Why the tracker runs as an infrastructure mode here (`MemoryTracker(compiled_regions=True)`): dynamo runs
a region eagerly when a non-infrastructure dispatch mode is active, which would trace the eager program.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memtrain.memory.modules import graph_tensors, is_compiled
from memtrain.memory.tracker import uncounted
from memtrain.strategies.checkpointing import _WRAPPED as CHECKPOINTED

RNG_STATES = 2  # what a compiled checkpointed block keeps besides its inputs (measured; eager keeps one)
RECOMPILES = 1024  # a trace's blocks are new modules: dynamo's per-code limit (8) would fall back to eager


def outermost_compiled(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The compiled modules of `model`, outermost only (a compiled module's call runs what it holds)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") or not outer for outer, _ in found)
        if is_compiled(module) and not inside:
            found.append((name, module))
    return found


def compile_description(model: nn.Module) -> str:
    """Which modules are compiled, for the trace cache's key ("" when none): their class names, counted."""
    names = [type(m).__name__ for _, m in outermost_compiled(model)]
    if not names:
        return ""
    outer = [n for n, _ in outermost_compiled(model)]
    return f"compiled {len(names)}: {sorted(set(names))} at {'model' if outer == [''] else 'submodules'}"


@contextlib.contextmanager
def traced_as_compiled(model: nn.Module) -> Iterator[bool]:
    """Inside, each compiled module of `model` runs its call compiled with `_fused_backend` (restored on exit);
    yields whether there were any. Dynamo fails loudly instead of falling back to eager at its limits."""
    compiled = [m for _, m in outermost_compiled(model)]
    before = [m._compiled_call_impl for m in compiled]
    for module in compiled:
        traced = torch.compile(_private_call(module), backend=_fused_backend)
        checkpointed = getattr(module, CHECKPOINTED, None) is not None
        module._compiled_call_impl = _holding_rng_states(traced) if checkpointed else traced
    limits = {
        "recompile_limit": RECOMPILES,
        "accumulated_recompile_limit": RECOMPILES,
        "fail_on_recompile_limit_hit": True,
    }
    try:
        with torch._dynamo.config.patch(limits):
            yield bool(compiled)
    finally:
        for module, call in zip(compiled, before, strict=True):
            module._compiled_call_impl = call


def _private_call(module: nn.Module) -> Callable[..., Any]:
    """`module._call_impl` on a code object of its own. Dynamo keeps its compiled entries and counts its
    recompiles per code object: on `Module._call_impl`'s own, the trace's entries (new fake modules at
    every trace) would count against the run's compiled modules, which fall back to eager past the limit
    (measured: a planned run then trained eagerly). These entries die with the traced model."""
    code = nn.Module._call_impl.__code__
    private = code.replace(
        co_name="_traced_call_impl", co_qualname="_traced_call_impl"
    )  # equal codes are one
    call = types.FunctionType(private, nn.Module._call_impl.__globals__)
    return types.MethodType(call, module)


def _fused_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """`aot_eager_decomp_partition` with Inductor's fusion drawn in: the forward and backward graphs run
    op by op, each value Inductor would not allocate computed `uncounted`."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import select_decomp_table

    return aot_autograd(  # type: ignore[no-any-return]
        fw_compiler=_fused_nop,
        bw_compiler=_fused_nop,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )(gm, example_inputs)


def _fused_nop(graph: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> Callable[..., Any]:
    """The graph run node by node (boxed: its inputs freed after their last use, as Inductor's code does),
    the values Inductor fuses away computed `uncounted`."""
    outputs = set(graph.graph.output_node().all_input_nodes)
    fused = {n for n in graph.graph.nodes if n.op == "call_function" and not materialized(n, outputs)}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]

    def run(args: list[Any]) -> Any:
        env = dict(zip(placeholders, args, strict=True))
        args.clear()
        return _FusedRun(graph, fused).run(initial_env=env)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


class _FusedRun(torch.fx.Interpreter):
    def __init__(self, graph: torch.fx.GraphModule, fused: set[torch.fx.Node]) -> None:
        super().__init__(graph)
        self._fused = fused

    def run_node(self, n: torch.fx.Node) -> Any:
        if n not in self._fused:
            return super().run_node(n)
        with uncounted():
            return super().run_node(n)


_REDUCTIONS = frozenset(
    {"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "var_mean", "any", "all"}
)


def materialized(node: torch.fx.Node, outputs: set[torch.fx.Node]) -> bool:
    """Whether Inductor allocates `node`'s value: a graph output (a saved tensor, a gradient), anything
    but a pointwise op or a view (matmuls, attention, reductions: kernels of their own or extern calls),
    or a value one of those reads. A pointwise value read only by pointwise ops, views and reductions is
    computed inside their kernel."""
    if node in outputs or _kind(node) not in ("pointwise", "view"):
        return True
    return any(_kind(user) == "other" for user in node.users)


def _kind(node: torch.fx.Node) -> str:
    """ "pointwise", "view", "reduction" or "other" (getitem of a tuple: a view of what its op made)."""
    target = node.target
    if node.op != "call_function":
        return "other"
    if target is operator.getitem:
        return "view"
    if not isinstance(target, torch._ops.OpOverload):
        return "other"
    if torch.Tag.pointwise in target.tags or target is torch.ops.prims.convert_element_type.default:
        return "pointwise"
    if target.is_view:
        return "view"
    return "reduction" if target.overloadpacket.__name__ in _REDUCTIONS else "other"


def _holding_rng_states(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call`, its output holding `RNG_STATES` generator states until its backward. A checkpointed region
    keeps the RNG state of its forward to replay it in the recompute (`preserve_rng_state`): the compiled
    block keeps two (measured: 2 x 5056 B on the CPU, beyond its output), and `torch.get_rng_state` is no
    op the tracker sees, so the trace allocates them as fake bytes."""

    def held(*args: Any, **kwargs: Any) -> Any:
        out = call(*args, **kwargs)
        given = next(graph_tensors((args, kwargs)), None)  # its gradient ends the block's backward
        if given is not None and next(graph_tensors(out), None) is not None:
            with torch.device(given.device):
                states = [torch.empty(RNG_STATES * torch.get_rng_state().numel(), dtype=torch.uint8)]
            given.register_hook(lambda grad: states.clear())
        return out

    return held
