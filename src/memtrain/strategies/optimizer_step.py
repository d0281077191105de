"""When the optimizer steps: after backward (`standard`), or parameter by parameter inside it (`in_backward`).

Why: a standard step needs every gradient at once, so a full fine-tune keeps fp32 gradients (4 bytes per
parameter) from backward to the step: with 8-bit states that is 10 bytes per parameter of model states,
and 40% of them are gradients. `in_backward` steps each parameter as soon as its gradient is accumulated
(a `register_post_accumulate_grad_hook`, as torchtune's `optimizer_in_bwd` and PyTorch's tutorial "How to
save memory by fusing the optimizer step into the backward pass" do) and frees that gradient at once:
about one parameter's gradient is alive at a time, and the optimizer phase, whose peak holds all
gradients, disappears. 8-bit states then cost ~6 bytes per parameter.

How: one optimizer per trainable parameter, built by the trainer's own `build_optimizer` (so the recipe's
optimizer and state format: fp32, bf16 or 8-bit states), behind `InBackwardOptimizer`, which the trainer
holds as it holds any optimizer: its `param_groups` are the per-parameter optimizers' groups (the trainer's
learning-rate schedule writes each step's `lr` into every one), its `state` reads theirs, and its
`state_dict` has the layout of one optimizer over the same parameters, so a checkpoint resumes under either
strategy. Each per-parameter step runs through `InBackwardOptimizer.step`, so its step hooks (the memory
tracker's) see it.

It is exact (the update of a standard step) only when the gradient is complete when the hook fires. Hence
the refusals (`check_plan`), each naming the key to change: gradient accumulation (the hook would step on
the first micro-step's part), sharding (DDP all-reduces gradients in buckets after the hook has fired; the
ZeRO stages reduce-scatter gradients and step their own sharded optimizer), `fp16-mixed` (its GradScaler
unscales and checks every gradient before the step) and `bf16-master` (its fp32 master copy is stepped after
backward). A non-finite gradient cannot skip the step as the standard strategy does (the parameters before
it have been updated when it appears): the step is counted as skipped, so `train.max_bad_steps` still stops
the run. Frozen parameters (adapters, quantised bases) get no optimizer and no hook.

`train.grad_clip` needs the global gradient norm before the first parameter steps. With it, a step runs
forward and backward twice, as LOMO/AdaLomo do (`passes`: 2; training/two_pass.py drives them): the first
backward only takes each gradient's norm and frees it (`begin_norm_pass`), the second steps each parameter
with its gradient times `min(1, clip / (norm + 1e-6))`, `clip_grad_norm_`'s factor (`begin_update_pass`).
The second pass replays the first's random numbers, so both see the same gradients: the update is the
standard step's. No more memory (the first pass holds one gradient at a time, no step temporaries), one
more forward and backward of compute (the planner's step-time model charges it). A non-finite norm is
known before any parameter steps, so such a step is skipped as a standard one is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from memtrain.errors import PlanError, Unsupported
from memtrain.strategies.micro_batching import MicroBatching, TokenBudget
from memtrain.strategies.precision import Precision
from memtrain.strategies.registry import RecipeKey, Registry, Strategy
from memtrain.strategies.sharding import Sharding

OptimizerBuilder = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerStep(Strategy):
    """`standard`: the trainer clips and steps one optimizer after backward.

    Fact the planner reads: `in_backward` (gradients are freed as backward makes them; no optimizer phase)."""

    kind: ClassVar[str] = "optimizer_step"
    name: ClassVar[str] = "standard"
    in_backward: ClassVar[bool] = False

    def check_plan(
        self, *, batching: MicroBatching, grad_clip: float | None, sharding: Sharding, precision: Precision
    ) -> None:
        """`Unsupported` (naming the key to change) when this step cannot be exact with these choices."""

    def wrap_builder(self, build: OptimizerBuilder) -> OptimizerBuilder:
        """The optimizer builder the trainer's setup uses (`build`: the trainer's `build_optimizer`)."""
        return build

    def passes(self, grad_clip: float | None) -> int:
        """Forward and backward passes a step runs (the step-time model's multiplier of compute)."""
        return 1


OPTIMIZER_STEP: Registry[OptimizerStep] = Registry(
    "optimizer_step",
    OptimizerStep,
    RecipeKey(
        "strategies",
        "optimizer_step",
        "standard",
        "standard: one optimizer step after backward; in_backward: each parameter stepped as soon as its "
        "gradient is accumulated, its gradient freed (no gradient memory; needs no accumulation and "
        "sharding none; with train.grad_clip each step runs forward and backward twice: norm, then update).",
        changes_trajectory=False,
    ),
)
OPTIMIZER_STEP.register(OptimizerStep)


@OPTIMIZER_STEP.register
@dataclass(frozen=True)
class InBackward(OptimizerStep):
    """`in_backward`: each parameter stepped in backward as soon as its gradient is accumulated."""

    name: ClassVar[str] = "in_backward"
    in_backward: ClassVar[bool] = True

    def check_plan(
        self, *, batching: MicroBatching, grad_clip: float | None, sharding: Sharding, precision: Precision
    ) -> None:
        why = self._refusal(batching, sharding, precision)
        if why is not None:
            raise Unsupported(f"strategies.optimizer_step: in_backward {why}")

    @staticmethod
    def _refusal(batching: MicroBatching, sharding: Sharding, precision: Precision) -> str | None:
        if isinstance(batching, TokenBudget):
            return (
                "steps on each micro-step's gradient, and batch.micro_tokens splits a step into several "
                "micro-steps: remove batch.micro_tokens, or set strategies.optimizer_step: standard"
            )
        if batching.accumulation_steps > 1:
            return (
                f"steps on each micro-step's gradient, and this plan accumulates {batching.accumulation_steps} "
                "micro-steps: set batch.micro_size so that batch.global_size = micro-batch x world size, "
                "or strategies.optimizer_step: standard"
            )
        if sharding.name != "none":
            how = (
                "DDP all-reduces gradients in buckets after the hook has stepped on the local ones"
                if sharding.name == "ddp"
                else f"{sharding.name} reduce-scatters gradients and steps its own sharded optimizer"
            )
            return f"needs strategies.sharding: none ({how}); or set strategies.optimizer_step: standard"
        if precision.name == "fp16-mixed" or precision.master_weights:
            what = "GradScaler unscales" if precision.name == "fp16-mixed" else "fp32 master copy takes"
            return (
                f"cannot run with precision {precision.name} (its {what} every gradient after backward): "
                "use strategies.precision fp32 or bf16-mixed, or strategies.optimizer_step: standard"
            )
        return None

    def wrap_builder(self, build: OptimizerBuilder) -> OptimizerBuilder:
        return lambda params: InBackwardOptimizer(params, build)

    def passes(self, grad_clip: float | None) -> int:
        return 1 if grad_clip is None else 2  # clipping: a norm pass before the update pass


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter (`build([p])`), each stepped by a post-accumulate-grad hook.

    A clipped step's first backward runs between `begin_norm_pass` and `begin_update_pass`: its hooks only
    take each gradient's norm. The second runs with the clip factor; `finish_step` ends either kind."""

    def __init__(self, params: Iterable[nn.Parameter], build: OptimizerBuilder) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("optimizer_step in_backward: no trainable parameter to step")
        self.inner = [build([p]) for p in self.params]
        self._by_param = {p: inner for p, inner in zip(self.params, self.inner, strict=True)}
        super().__init__(self.params, self.inner[0].defaults)
        self.param_groups = [group for inner in self.inner for group in inner.param_groups]
        self.state = _States(self._by_param)  # type: ignore[assignment]
        self._ready: list[nn.Parameter] = []
        self._norms: list[torch.Tensor] = []  # this pass's per-gradient norms
        self._measuring = False  # a clipped step's first pass: norms only, no step
        self._clip: tuple[torch.Tensor, float] | None = None  # (factor, norm) of a clipped step's update
        self._stepped = False  # some parameter of the step in progress has stepped
        for param in self.params:
            param.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._measuring:
            self._take_norm(param)
            param.grad = None
            return
        self._ready.append(param)  # type: ignore[arg-type]
        self.step()

    @torch.no_grad()
    def _take_norm(self, param: torch.Tensor) -> None:
        assert param.grad is not None
        self._norms.append(torch.linalg.vector_norm(param.grad, dtype=torch.float32))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Step the parameter whose gradient backward just accumulated (called by its hook), or, called
        directly, every parameter holding a gradient; each gradient is freed after its step (scaled first
        by the clip factor in a clipped step's update pass)."""
        assert closure is None, "optimizer_step in_backward takes no closure"
        ready = self._ready or [p for p in self.params if p.grad is not None]
        self._ready = []
        for param in ready:
            grad = param.grad
            if grad is None:
                continue
            self._take_norm(param)
            if self._clip is not None:
                grad.mul_(self._clip[0])
            self._stepped = True
            self._by_param[param].step()
            param.grad = None

    def begin_norm_pass(self) -> None:
        """The next backward only measures: each gradient's norm is taken and the gradient freed."""
        self._norms, self._measuring, self._clip = [], True, None

    def begin_update_pass(self, max_norm: float) -> bool:
        """End the norm pass; the next backward steps each parameter with its gradient times the factor
        `clip_grad_norm_` would apply. False (nothing to step: the step is skipped) when the norm is not
        finite."""
        norm = self._total_norm()
        factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self._norms, self._measuring, self._clip = [], False, (factor, float(norm))
        return math.isfinite(float(norm))

    def _total_norm(self) -> torch.Tensor:
        if not self._norms:
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(self._norms))

    def finish_step(self) -> float:
        """The norm of the step's gradients before clipping (the trainer's `grad_norm`), read once after
        backward."""
        norm = self._clip[1] if self._clip is not None else float(self._total_norm())
        self._norms, self._measuring, self._clip, self._stepped = [], False, None, False
        return norm

    def check_redoable(self, step: int) -> None:
        """`PlanError` when some parameters of the step in progress have already stepped: the step cannot
        be redone (an out-of-memory error in backward) without stepping them twice."""
        if self._stepped:
            raise PlanError(
                f"out of memory in backward at step {step + 1}, after strategies.optimizer_step: in_backward "
                "had updated some parameters: the step cannot be redone exactly. Resume from the last "
                "checkpoint (--resume) with strategies.checkpointing: full, or strategies.optimizer_step: "
                "standard"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients and the norms of the pass in progress (an attempt redone after an
        out-of-memory error); a clipped step's factor and pass stay."""
        super().zero_grad(set_to_none)
        self._ready, self._norms = [], []

    def state_dict(self) -> dict[str, Any]:
        """The layout of one optimizer over `params` (one group, states indexed by position)."""
        inner = [o.state_dict() for o in self.inner]
        group = {k: v for k, v in inner[0]["param_groups"][0].items() if k != "params"}
        state = {i: d["state"][0] for i, d in enumerate(inner) if 0 in d["state"]}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        count = sum(len(g["params"]) for g in groups)
        if count != len(self.params):
            raise ValueError(f"the saved optimizer has {count} parameters, this one {len(self.params)}")
        group_of = {i: g for g in groups for i in g["params"]}
        saved = state_dict["state"]
        for index, inner in enumerate(self.inner):
            group = {k: v for k, v in group_of[index].items() if k != "params"}
            one = {0: saved[index]} if index in saved else {}
            inner.load_state_dict({"state": one, "param_groups": [{**group, "params": [0]}]})
        self.param_groups = [group for inner in self.inner for group in inner.param_groups]


class _States(Mapping[torch.Tensor, dict[str, Any]]):
    """The per-parameter optimizers' states as one read-only mapping, parameter -> its state (what the
    memory tracker and the trainer's checks read from `optimizer.state`)."""

    def __init__(self, by_param: dict[nn.Parameter, torch.optim.Optimizer]) -> None:
        self._by_param = by_param

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        inner = self._by_param.get(param)  # type: ignore[call-overload]
        if inner is None or param not in inner.state:
            raise KeyError(param)
        return dict(inner.state[param])

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, inner in self._by_param.items() if p in inner.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)
