"""What the planner knows about the trainer's model before building it: its shape and its traced activations.

The shape (every parameter's size, block and whether it trains; leading dimensions for FSDP2's padding;
buffer bytes) comes from the trainer's `build_model()` on the meta device: no memory, a 70B model in
about a second. Activations come from `activations.trace_step` under fake tensors, at two micro-batch
sizes, once per (precision, checkpointing mode, loss); the fits are cached, so a search over hundreds of
candidates costs a handful of traces. When the trainer can build the model at a reduced depth
(`ModelSpec.build_clone`), a clone of at most three blocks is traced; otherwise the whole model is.

Why the clone is checked: it stands for the model only when every middle block is built like the clone's
middle block (same module types, same parameter shapes, same kind of layer) and each block's forward runs
once per micro-step. Blocks that differ (hybrids, alternating sizes, alternating kinds) are traced whole at
the real depth, still cut per block. Kinds matter even between blocks built alike: Gemma-2 alternates
sliding-window and global attention layers, each kind reads its own mask (made once per forward), and a
checkpointed block holds its kind's mask until the first block of that kind runs its backward. The clone
(sliding, global, global) has its middle block free the global mask, and the walk repeats the middle block
for every middle one: it freed the mask once per middle block, so a later micro-step started that many
masks too low (tiny gemma2, eager, bf16-mixed + full checkpointing, micro 4 of 8: -1.21%, one 64 KiB
mask of 4 rows; the whole model traces it to the byte). A module's plain settings (`_settings`: an
attention's `layer_type`, a `sliding_window` of None) tell the kinds apart. The first block counts too:
when it is of another kind than the (alike) middle ones, the first middle block is the first of its kind
and frees that kind's mask, which the walk repeats for every middle block (tiny MiMo-V2-Flash, a global
first layer and sliding ones after: -0.74% fp32 and -1.20% bf16-mixed with selective recompute, where
every block holds its inputs); such a model is traced whole too (`_kinds_differ`).
Blocks that run several times per forward (recurrent cycles, shared blocks) make block hooks cut the step at
the wrong places: such a model is traced whole with each micro-step's forward and backward as one segment
(`trace_step(block_segments=False)`) — exact for the plan's mode, slower for deep models, no memory.

Why the smallest and the largest micro-batch the search considers as the two traced sizes: within a
segment the peak is the highest of many moments, each linear in the rows, so it is convex in the rows and
a straight line can only be exact where it was measured. Through the two ends of the range the line is
exact there and on the safe side in between.

Why one row is a size of its own (`fit_rows`): the moments are linear in the rows only from two rows on.
`torch.matmul` folds the batch dimensions of a broadcast operand into a free view when the batch has one
row and copies them (expand, then reshape) when it has more: a DeepSeek sparse-attention indexer's single
key head against its query heads (`[B, S, H, D] @ [B, 1, D, T]`) copies S·D·T fp32 per row from two rows on
and nothing at one. Measured on tiny deepseek_v32 (bf16-mixed, full checkpointing), a block's forward peak
is 5.90 MB at 1 row, then 12.66, 18.71, 24.77 MB at 2, 3, 4 rows: 1 row sits 0.70 MB below the line of the
others, so a line through 1 and 8 rows under-predicted 4 rows' step peak by 1.1% (hy_v4: 3.6%); at real
sizes the copy is gigabytes. So when the range starts at one row, a micro-batch of one row reads the fit
through 1 and 2 rows, larger ones the fit through 2 rows and the largest: every traced size exact, convex
from 2 rows on. Traces are cached per size, so the three sizes cost three traces.

Why traces can be shared between probes, and only inside `shared_traces()`: a traced size is a function of
the spec's hooks, the size's strategies and rows, the adapters, the base quantisation and torch's thread
count and default dtype, nothing else, so two probes of equal `ModelSpec.trace_key` (which the trainer sets
only where its key determines its hooks) with the same hook functions can share it. A program plans one job
and needs none of this; a test suite that plans the same tiny model in a hundred tests turns it on. It is
off by default because what the key cannot see (a hook patched from outside, a kernel swapped in torch)
would be shared too; and a trace on real tensors (trace_fallback.py) is never shared. Between programs
(a what-if asked again), trace_cache.py keeps the same traces on disk under the same conditions, with the
hooks' code and memtrain's own sources in the key, on unless `MEMTRAIN_CACHE_DIR=off`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from memtrain.errors import MemtrainError, Unsupported
from memtrain.memory import fake_tensors
from memtrain.memory.footprint import ModelShape
from memtrain.planner import activations, trace_cache
from memtrain.planner.activations import (
    MICRO_STEPS,
    FittedTrace,
    ParamKey,
    SegmentKey,
    StepTrace,
    clone_depth,
    fit,
    param_keys,
    trace_step,
)
from memtrain.planner.attention_kernels import Capability
from memtrain.planner.compiled_trace import compile_description
from memtrain.planner.spec import Batch, ModelSpec
from memtrain.planner.trace_fallback import clone_step_bytes, trace_for_real
from memtrain.strategies.adapters import Adapters
from memtrain.strategies.blocks import model_shape, output_head
from memtrain.strategies.checkpointing import Checkpointing, NoCheckpointing
from memtrain.strategies.compile import Compile
from memtrain.strategies.loss import Loss
from memtrain.strategies.precision import Precision
from memtrain.strategies.quantization import Quantization

TraceKey = tuple[
    Precision, Checkpointing, tuple[int, int], torch.dtype | None, Loss, Capability | None, Compile
]
TracedSize = tuple[Precision, Checkpointing, torch.dtype | None, Loss, Capability | None, int, Compile]
"""One traced size: precision, checkpointing mode, weights dtype, loss, CUDA capability, rows, compile."""

_shared: dict[Hashable, StepTrace] | None = None  # `shared_traces`: None (off) unless inside it


@contextlib.contextmanager
def shared_traces(memo: dict[Hashable, StepTrace] | None = None) -> Iterator[dict[Hashable, StepTrace]]:
    """Within it, probes share their traced sizes through `memo` (a new one by default) when their specs
    have equal `trace_key`s and the same hook functions (module docstring)."""
    global _shared
    previous, _shared = _shared, ({} if memo is None else memo)
    try:
        yield _shared
    finally:
        _shared = previous


@dataclass
class ModelProbe:
    """The trainer's model as the planner sees it; `progress` receives a line per trace."""

    spec: ModelSpec
    progress: Callable[[str], None] = field(default=lambda _line: None)
    adapters: Adapters = field(default_factory=Adapters)  # the recipe's: they change what trains
    quantization: Quantization = field(default_factory=Quantization)  # the recipe's base quantisation
    shape: ModelShape = field(init=False)
    dim0: dict[str, int] = field(init=False)
    buffer_bytes: int = field(init=False)
    hidden_size: int = field(init=False)
    linear_weights: frozenset[str] = field(init=False)  # what base quantisation would store in 4/8 bits
    seq_len: int = field(init=False)
    row_bytes: int = field(init=False)
    head_numel: int = field(init=False)  # the output head's weight (what `chunked` recomputes)
    whole_model: str = field(init=False, default="")  # why the clone cannot stand for the model ("": it can)
    compiled: str = field(init=False, default="")  # which modules `build_model` compiles ("": none)
    block_segments: bool = field(init=False, default=True)  # False: blocks re-entered, one segment per phase
    _fits: dict[TraceKey, FittedTrace] = field(init=False, default_factory=dict)
    # per traced size, keyed by how the model was traced too (clone or whole, cut per block or not)
    _steps: dict[tuple[object, ...], StepTrace] = field(init=False, default_factory=dict)
    _failed: dict[TraceKey, Unsupported] = field(init=False, default_factory=dict)
    _param_keys: dict[str, ParamKey] = field(init=False)  # every parameter's (block, name in block)
    sizes_traced: int = field(init=False, default=0)  # traced sizes run by this probe (progress lines)
    sizes_read: int = field(init=False, default=0)  # traced sizes read from the trace cache

    def __post_init__(self) -> None:
        try:
            with torch.device("meta"):
                model = self.spec.build_model()
                if not isinstance(model, nn.Module):
                    raise MemtrainError(
                        f"{self.spec.name} must return a torch.nn.Module; it returned {type(model).__name__}"
                    )
                blocks = self.spec.blocks(model)
                self.adapters.apply(model)
        except MemtrainError:
            raise
        except Exception as exc:
            raise Unsupported(
                f"cannot build {self.spec.name} on the meta device to plan it: "
                f"{type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        self.shape = model_shape(model, blocks)
        head = output_head(model)
        weight = None if head is None else getattr(model.get_submodule(head), "weight", None)
        self.head_numel = weight.numel() if isinstance(weight, torch.Tensor) else 0
        self.linear_weights = frozenset(
            f"{name}.weight"
            for name, module in model.named_modules()
            if type(module) is nn.Linear and name != head and not self.adapters.owns(f"{name}.weight")
        )
        self.dim0 = {name: p.shape[0] if p.dim() else 1 for name, p in model.named_parameters()}
        self._param_keys = param_keys(model, blocks)
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self.hidden_size = _hidden_size(blocks)
        one_row = self.spec.micro_batch(1)
        self.seq_len = max((t.numel() for t in one_row.values()), default=1)
        self.row_bytes = _nbytes(one_row)
        self.whole_model = self._clone_mismatch(blocks)
        self.compiled = compile_description(model)

    def _clone_mismatch(self, blocks: list[nn.Module]) -> str:
        """Why the clone's blocks cannot stand for the model's ("" when they can): middle blocks built
        differently from one another, or clone blocks that are not built like the blocks they stand for."""
        clone = self.spec.build_clone
        depth = clone_depth(len(blocks))
        if clone is None or depth == len(blocks):
            return ""
        kinds = [_structure(block) for block in blocks]
        if len(set(kinds[1:-1])) > 1:
            return f"its middle blocks are of {len(set(kinds[1:-1]))} different structures or kinds"
        if _kinds_differ(blocks[0], blocks[1]):
            return "its first block is of another kind than its middle blocks"
        try:
            with torch.device("meta"):
                model = clone(depth)
                self.adapters.apply(model)
                cloned = [_structure(block) for block in self.spec.blocks(model)]
        except MemtrainError:
            raise
        except Exception as exc:  # the trace will meet it again and fall back there
            return f"its {depth}-block clone cannot be built ({type(exc).__name__})"
        if cloned != [kinds[0], kinds[1], kinds[-1]]:
            return f"its {depth}-block clone is not built like the model's first, middle and last blocks"
        return ""

    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    def step_data_bytes(self, rows: int) -> int:
        """The step batch of this rank on the device (the trainer moves every micro-batch of a step at once)."""
        return rows * self.row_bytes

    def fit_rows(self, rows: tuple[int, int], tokens: int) -> tuple[int, int]:
        """The two traced sizes (rows) the fit for a micro-batch of `tokens` is drawn through, in the search's
        range `rows` (smallest, largest): the range's ends, but one row is a size of its own when the range
        starts there (module docstring): (1, 2) for a micro-batch of at most one row, (2, largest) above."""
        low, high = rows
        if low != 1 or high <= 2:
            return rows
        return (1, 2) if tokens <= self.seq_len else (2, high)

    def trace(
        self,
        precision: Precision,
        mode: Checkpointing,
        rows: tuple[int, int],
        weights_dtype: torch.dtype | None = None,
        loss: Loss | None = None,
        cuda_capability: Capability | None = None,
        compile: Compile | None = None,
    ) -> FittedTrace:
        """`_trace`, with its failures remembered: a search asks for the same fit once per candidate, and a
        trace that cannot run (every fallback included) fails the same way each time."""
        key = (precision, mode, rows, weights_dtype, loss or Loss(), cuda_capability, compile or Compile())
        if key in self._failed:
            raise self._failed[key]
        try:
            return self._trace(precision, mode, rows, weights_dtype, loss, cuda_capability, compile)
        except Unsupported as exc:
            self._failed[key] = exc
            raise

    def _trace(
        self,
        precision: Precision,
        mode: Checkpointing,
        rows: tuple[int, int],
        weights_dtype: torch.dtype | None = None,
        loss: Loss | None = None,
        cuda_capability: Capability | None = None,
        compile: Compile | None = None,
    ) -> FittedTrace:
        """The activation fit for one precision and one traced checkpointing mode, drawn through traces at
        the two micro-batch sizes `rows` (the search asks for `fit_rows`; fits and traces are cached).
        `weights_dtype`: the sharding backend hands the forward weights of this dtype (FSDP2's and
        DeepSpeed's bf16-mixed).
        `loss`: the plan's loss strategy (standard by default). `cuda_capability`: trace attention as the CUDA
        kernel of a GPU of this compute capability (attention_kernels.py); None: this CPU's kernels.
        `compile`: the plan's compile (none by default), traced as the compiled program."""
        loss, compile = loss or Loss(), compile or Compile()
        if rows[0] == rows[1]:
            rows = (rows[0], 2 * rows[0])
        key = (precision, mode, rows, weights_dtype, loss, cuda_capability, compile)
        if key not in self._fits:
            clone = None if self.whole_model else self.spec.build_clone
            depth = clone_depth(self.num_blocks) if clone is not None else self.num_blocks
            weights = _weights_and_loss(weights_dtype, loss, compile)
            why = f"; whole model: {self.whole_model}" if self.whole_model else ""
            self.progress(
                f"tracing {precision.describe()}{weights} / checkpointing {mode.describe()} ({depth} of "
                f"{self.num_blocks} blocks, {rows[0]} and {rows[1]} x {self.seq_len} tokens{why})"
            )
            clone_build = (lambda: clone(depth)) if clone is not None else None
            build = clone_build or self.spec.build_model

            def step(build: Callable[[], nn.Module], count: int) -> StepTrace:
                """One traced size, cached: the fits of a range share their sizes (`fit_rows`)."""
                size = (precision, mode, weights_dtype, loss, cuda_capability, count, compile)
                return self._size(size, build, whole=build is not clone_build)

            def traced(build: Callable[[], nn.Module] = build) -> FittedTrace:
                small, large = (step(build, count) for count in rows)
                unmapped = _unreliable_blocks(small)
                if unmapped and self.block_segments:  # blocks cut wrongly: whole, a segment a phase
                    self.whole_model = unmapped
                    self.block_segments = False
                    self._fits.clear()  # earlier fits were cut per block too
                    self.progress(
                        f"tracing {precision.describe()}{weights} / checkpointing {mode.describe()} again "
                        f"({self.num_blocks} of {self.num_blocks} blocks; whole model: {self.whole_model})"
                    )
                    return traced(self.spec.build_model)
                return fit(small, large)

            try:
                self._fits[key] = traced()
            except MemtrainError:
                raise
            except Exception as exc:  # a model or kernel the fake-tensor trace cannot run: real tensors
                cause = f"{type(exc).__name__}: {_first_line(exc)}"
                tokens = rows[1] * self.seq_len
                size = clone_step_bytes(self.shape, depth, tokens, self.hidden_size, self.head_numel)
                try:
                    name = f"{self.spec.name} ({precision.describe()}, checkpointing {mode.describe()})"
                    self._fits[key] = trace_for_real(name, cause, size, traced, self.progress)
                except Unsupported:
                    if clone is None:
                        raise
                    # Neither tensor kind runs the clone (its cut breaks a layer map: Zamba2's shared
                    # blocks): the whole model under fake tensors, which costs no memory.
                    self.progress(f"tracing the whole model: its {depth}-block clone cannot run ({cause})")
                    whole = _fit_or_none(lambda: traced(self.spec.build_model))
                    if whole is None:
                        raise
                    self.whole_model = f"its {depth}-block clone cannot run ({cause})"
                    self._fits.clear()  # fits of the clone would stand for other blocks than this one's
                    self._fits[key] = whole
        return self._fits[key]

    def _size(self, traced: TracedSize, build: Callable[[], nn.Module], whole: bool) -> StepTrace:
        """One traced size, cached (in this probe, in `shared_traces()`, on disk): `traced` is the
        precision, checkpointing mode, weights dtype, loss, CUDA capability, rows and compile; `whole`:
        `build` builds the whole model, not the clone."""
        precision, mode, weights_dtype, loss, cuda_capability, count, compile = traced
        size = (*traced, whole, self.block_segments)
        shared = self._shared_key(size, on_disk=True)
        if shared is not None and _shared is not None and shared in _shared:
            self._steps[size] = _shared[shared]
        on_disk = None if size in self._steps else self._disk_key(size, shared)
        if on_disk is not None:
            stored = trace_cache.load(on_disk)
            if stored is not None:
                self._steps[size] = stored
                self.sizes_read += 1
                if shared is not None and _shared is not None:
                    _shared[shared] = stored
        if size not in self._steps:
            self.sizes_traced += 1
            self._steps[size] = trace_step(
                build,
                self.spec.blocks,
                self._batch,
                self.spec.loss,
                precision,
                mode,
                count,
                weights_dtype,
                self.adapters,
                self.quantization,
                loss,
                cuda_capability,
                self.block_segments,
                compile,
            )
            if shared is not None and _shared is not None:
                _shared[shared] = self._steps[size]
            if on_disk is not None:
                trace_cache.store(on_disk, self._steps[size])
        return self._steps[size]

    def first_size(
        self,
        precision: Precision,
        mode: Checkpointing,
        rows: tuple[int, int],
        weights_dtype: torch.dtype | None = None,
        loss: Loss | None = None,
        cuda_capability: Capability | None = None,
        compile: Compile | None = None,
    ) -> None:
        """The smaller traced size of `trace`'s fit at `rows`, alone, kept for that fit: what a reader of
        any one trace needs (`no_grad`) costs one size, which the fit reuses. What one size cannot do alone
        (a trace that fails and falls back) is left to the whole fit (`trace`)."""
        loss, compile = loss or Loss(), compile or Compile()
        clone = None if self.whole_model else self.spec.build_clone
        depth = clone_depth(self.num_blocks) if clone is not None else self.num_blocks
        build = (lambda: clone(depth)) if clone is not None else self.spec.build_model
        self.progress(
            f"tracing {precision.describe()}{_weights_and_loss(weights_dtype, loss, compile)} / checkpointing "
            f"{mode.describe()} ({depth} of {self.num_blocks} blocks, {rows[0]} x {self.seq_len} tokens: "
            "which parameters get a gradient)"
        )
        try:
            traced = (precision, mode, weights_dtype, loss, cuda_capability, rows[0], compile)
            first = self._size(traced, build, clone is None)
        except MemtrainError:
            raise
        except Exception:  # the fit knows the fallbacks (real tensors, the whole model)
            self.trace(precision, mode, rows, weights_dtype, loss, cuda_capability, compile)
            return
        if self.block_segments and _unreliable_blocks(first):
            # blocks cut wrongly (they run several times a forward): the fit traces whole, before any plan
            # is walked (which modes a plan is traced in depends on it: search._traced_as_itself)
            self.trace(precision, mode, rows, weights_dtype, loss, cuda_capability, compile)

    def no_grad(
        self,
        precision: Precision,
        rows: tuple[int, int],
        first: Callable[[], object] | None = None,
    ) -> frozenset[str]:
        """The trainable parameters (real names) the step leaves without a gradient, hence without optimizer
        state: read from any trace (which parameters get one depends on the model, not on the plan); when
        none is cached, from what `first()` traces (the search passes one size of a fit the plan it scores
        is walked with: `first_size`), else from a trace without checkpointing of `precision` at `rows`. A
        real block stands for its clone block's names."""
        if not self._fits and not self._steps:
            if first is not None:
                first()
            else:
                self.trace(precision, NoCheckpointing(), rows)
        fitted = next(iter(self._fits.values()), None) or next(iter(self._steps.values()))
        count, depth = self.num_blocks, fitted.depth
        return frozenset(
            name
            for name, (block, inner) in self._param_keys.items()
            if (_clone_block(block, count, depth), inner) in fitted.no_grad
        )

    def _batch(self, rows: int) -> Batch:
        return self.spec.micro_batch(rows)

    def _shared_key(self, size: tuple[object, ...], on_disk: bool = False) -> Hashable | None:
        """What a traced `size` of this probe is shared under in `shared_traces()` (`on_disk`: or stored
        under in the trace cache, trace_cache.py, when that is on); None: not shared (off, no `trace_key`, a
        hook that is not a plain function or method, or a trace on anything but the fake tensors
        `trace_step` makes)."""
        cached = on_disk and trace_cache.cache_dir() is not None
        if (_shared is None and not cached) or self.spec.trace_key is None:
            return None
        if activations.fake_tensors is not fake_tensors:
            return None
        spec = self.spec
        hooks = tuple(_hook_identity(h) for h in (spec.build_model, spec.blocks, spec.micro_batch, spec.loss))
        clone = None if spec.build_clone is None else _hook_identity(spec.build_clone)
        if None in hooks or (spec.build_clone is not None and clone is None):
            return None
        hooks += (clone,)
        threads = (torch.get_num_threads(), torch.get_default_dtype())
        return (spec.trace_key, hooks, size, self.adapters, self.quantization, self.compiled, threads)

    def _disk_key(self, size: tuple[object, ...], shared: Hashable | None) -> str | None:
        """The trace cache's key of the traced `size` (None: not cached; `shared`, its `_shared_key`, is None
        for every probe whose traces may not be shared)."""
        if shared is None or trace_cache.cache_dir() is None:
            return None
        spec = self.spec
        return trace_cache.disk_key(
            spec.trace_key,
            (spec.build_model, spec.blocks, spec.micro_batch, spec.loss, spec.build_clone),
            size,
            (self.adapters, self.quantization, self.compiled),
            (torch.get_num_threads(), torch.get_default_dtype()),
        )


def _weights_and_loss(weights_dtype: torch.dtype | None, loss: Loss, compile: Compile) -> str:
    """How a progress line names a trace's weights dtype, loss and compile (nothing for the defaults)."""
    weights = f", {str(weights_dtype).removeprefix('torch.')} weights" if weights_dtype else ""
    compiled = f", compile {compile.name}" if compile.compiled else ""
    return weights + (f", loss {loss.describe()}" if loss.name != "standard" else "") + compiled


def _hook_identity(hook: Callable[..., object] | None) -> Hashable | None:
    """A hook's function (and, for a bound method, its instance's class): another spec with the same key
    but a hook swapped (`dataclasses.replace(spec, loss=...)`) has another identity. None: not a plain
    function or method."""
    function = getattr(hook, "__func__", None)
    if function is not None:
        return (function, type(getattr(hook, "__self__", None)))
    return getattr(hook, "__code__", None)


def _fit_or_none(traced: Callable[[], FittedTrace]) -> FittedTrace | None:
    try:
        return traced()
    except Exception:  # the caller reports its own, earlier failure
        return None


def _clone_block(block: int, count: int, depth: int) -> int:
    """The clone block that real block `block` of `count` is traced as (`memory_model._runs`); -1: none."""
    if block < 0 or count <= depth:
        return block
    return 0 if block == 0 else depth - 1 if block == count - 1 else 1


def _unreliable_blocks(trace: StepTrace) -> str:
    """Why the block segments of `trace` cannot be walked ("" when they can): a block's forward ran more
    than once in a micro-step, or never ran through the block's module call (no segment to map it to)."""
    if trace.reentered:
        return "a block's forward runs more than once per micro-step"
    if any(SegmentKey(MICRO_STEPS[0], "fwd.block", i) not in trace.segments for i in range(trace.depth)):
        return "a block's forward is not run through its module (its block hooks never fire)"
    return ""


def _hidden_size(blocks: list[nn.Module]) -> int:
    """The width the blocks work at: the commonest last dimension of the first block's parameters (the
    input features of its projections and the size of its norms)."""
    if not blocks:
        return 0
    widths = Counter(p.shape[-1] for p in blocks[0].parameters() if p.dim())
    return widths.most_common(1)[0][0] if widths else 0


def _kinds_differ(first: nn.Module, middle: nn.Module) -> bool:
    """Whether a module of the first block and the module of the same name and type in the middle block
    are set up as different kinds (`_settings`); modules of different types (a dense MLP against
    experts) say nothing of the kind."""
    others = dict(middle.named_modules())
    for name, module in first.named_modules():
        other = others.get(name)
        if other is not None and type(other) is type(module) and _settings(other) != _settings(module):
            return True
    return False


def _structure(block: nn.Module) -> tuple[tuple[str, str, tuple[object, ...]], ...]:
    """What a block is built of: each submodule's type and settings (`_settings`), each parameter's name and
    shape."""
    modules = tuple((name, type(m).__name__, _settings(m)) for name, m in block.named_modules())
    return modules + tuple((name, "parameter", tuple(p.shape)) for name, p in block.named_parameters())


def _settings(module: nn.Module) -> tuple[tuple[str, object], ...]:
    """The public plain attributes that say what kind of layer a module is (an attention's `layer_type`,
    a `sliding_window` of None in a global layer): strings, booleans and None by value, numbers by type
    only (a `layer_idx` differs in every block and says nothing of its kind)."""
    return tuple(
        (name, value if value is None or isinstance(value, str | bool) else type(value).__name__)
        for name, value in vars(module).items()
        if not name.startswith("_") and (value is None or isinstance(value, str | bool | int | float))
    )


def _nbytes(batch: Batch) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""
