"""Step-time model: which of the plans that fit is fastest. Every device rate is in this file; what a
strategy costs relative to them is a fact of the strategy.

The planner needs a ranking, not a stopwatch, so the model is a handful of terms with physical meaning,
each a count (FLOPs, bytes) divided by a rate:

- compute: 6 FLOPs per parameter per token plus attention (12·L·h·s per token), at the matmul rate of
  the precision's compute class, slowed by small micro-batches: a micro-batch of t tokens runs at t / (t + t_half) of full speed;
- recompute: checkpointed blocks run their forward again (`Checkpointing.recompute`: "forward", all of
  it; "elementwise", a device-dependent share), plus the share of the blocks' weight matmuls the mode
  recomputes (`Checkpointing.recomputed_matmuls`: `selective-op` redoes every other `mm` of a block,
  taken as half of its 2 FLOPs per block weight per token; the attention core it keeps);
- the loss: `chunked` runs the head's forward again in backward (2 FLOPs per head weight per token);
  `fused` computes its gradients in forward, the same FLOPs as `standard`;
- a fixed cost per micro-step (kernel launches, Python, hooks), which makes accumulation cost something;
- the optimizer step: bytes of weights, gradients and states it streams, at device-memory bandwidth, times
  the state format's `relative_step_cost` (dequantising 8-bit states costs more than fp32 AdamW); stepped
  in backward (`optimizer_step: in_backward`), the same bytes plus a fixed cost per parameter tensor (one
  small optimizer step each, where the standard step runs torch's multi-tensor kernels), so with memory to
  spare the standard step ranks first; with `train.grad_clip` it runs forward and backward twice (a norm
  pass, then the update pass: `OptimizerStep.passes`), so compute, recompute and the micro-steps count
  twice and the planner takes it only when memory needs it;
- communication: the sharding's `gradient_sync` (all-reduce or reduce-scatter), once per step or, with
  `gradient_reduction=per_micro_step`, once per micro-step (`Sharding.reductions_per_step`), and
  `parameter_gathers` (per step, per micro-step) over the interconnect, partly hidden behind compute;
- offload: activations (checkpointing `offload`) over the host link; states (`sharding_offload`) there and
  back once per step (parameter offload: once per micro-step, each gather copies the weights in), partly
  hidden, and the optimizer step on the host's CPU, which streams the offloaded states at the host's
  memory rate (`host_step_bandwidth`) and hides behind nothing. For a model large enough to need it, these
  seconds exceed what recomputation or smaller micro-batches cost, so offload ranks below the plans that
  fit without it (tests/planner/test_offload_choice.py);
- compile (`strategies.compile`): a compiled plan's compute, recompute and micro-step terms are divided
  by `CostModel.compile_speedup`, learned per device from the measured steps of compiled runs
  (step_time_calibration.py) and 1.0 until one was measured: compile is never assumed faster, so with
  nothing learned a compiled plan ties with its eager twin and the eager one ranks first (`Scored.order`).
  Compile time (the first step) is paid once and not in the steady step this model ranks.

Rates are those of a device class (`SPEEDS`): the constants a what-if target (`memtrain plan --gpu`) is
ranked with. A plan for the device that is here is ranked with per-term multipliers that `calibrate` fits to
seconds measured on it (step_time_calibration.py: the first steps of runs, cached per machine, and a
timed probe of the model being planned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from memtrain.plan import Plan


@dataclass(frozen=True)
class DeviceSpeed:
    matmul_flops: dict[str, float]  # achievable dense FLOP/s per compute class (`Precision.compute`)
    half_speed_tokens: float  # micro-batch tokens at which compute runs at half its full-batch speed
    micro_step_s: float  # fixed cost of one micro-step
    memory_bandwidth: float  # device memory, bytes/s
    host_link: float  # device <-> host, bytes/s
    host_step_bandwidth: float  # bytes/s the host's CPU optimizer streams (offloaded states), per rank
    interconnect: float  # per-rank collective bandwidth, bytes/s
    selective_recompute: float  # `selective`: recompute time as a share of the blocks' forward
    checkpoint_call_s: float  # fixed cost of one checkpointed block per micro-step (RNG state, hooks)
    tensor_step_s: float  # fixed cost of stepping one parameter tensor on its own (in_backward)


SPEEDS: dict[str, DeviceSpeed] = {
    # H100-class: ~60% of 989 TFLOP/s bf16 dense; fp32 without TF32 at ~50 TFLOP/s; HBM3 3.35 TB/s;
    # PCIe 5 x16 ~50 GB/s; NVLink 4 ~300 GB/s effective per rank for ring collectives. Selective
    # recompute redoes only elementwise work (the playbook: ~3% of compute on GPT-3); bitsandbytes'
    # fused 8-bit kernels stream fewer bytes at about the same rate.
    "cuda": DeviceSpeed(
        matmul_flops={"fp32": 50e12, "bf16": 600e12, "fp16": 600e12, "fp8": 900e12},
        half_speed_tokens=512.0,
        micro_step_s=3e-3,
        memory_bandwidth=3.0e12,
        host_link=50e9,
        # torch's AdamW on the host (memtrain keeps the recipe's optimizer under offload): ~20 GB/s per rank,
        # a server's ~300 GB/s of host memory bandwidth shared by 8 ranks and slowed by Adam's arithmetic
        host_step_bandwidth=20e9,
        interconnect=300e9,
        selective_recompute=0.1,
        checkpoint_call_s=2e-4,
        tensor_step_s=3e-5,  # ~5 kernel launches and a Python hook per tensor
    ),
    # One thread of this 2-core CPU, measured (min of 3 runs of 8 steps, a 1.3M-parameter llama at
    # 2k tokens per step): ~130 GFLOP/s fp32 from 128 tokens up, 3 ms per micro-step, 1.3 ms per
    # checkpointed block call; torch's selective checkpointing runs its policy per op and costs a little
    # more than recomputing the whole block here (the bf16-state and 8-bit optimizers' 3x and 7x slower
    # steps per byte are their strategies' `relative_step_cost`). bf16 autocast is slower than fp32 here.
    "cpu": DeviceSpeed(
        matmul_flops={"fp32": 130e9, "bf16": 50e9, "fp16": 25e9, "fp8": 5e9},
        half_speed_tokens=8.0,
        micro_step_s=3e-3,
        memory_bandwidth=5e9,
        host_link=5e9,
        host_step_bandwidth=5e9,  # unused: offload is excluded on a CPU target
        interconnect=2e9,
        selective_recompute=1.3,
        checkpoint_call_s=1.3e-3,
        tensor_step_s=2e-5,  # a hook and an optimizer call per tensor (CPU AdamW loops per tensor anyway)
    ),
}
TERMS = ("compute", "recompute", "micro_steps", "optimizer", "communication", "offload")
COMPILED_TERMS = ("compute", "recompute", "micro_steps")  # what a compiled program runs
UNCALIBRATED = (1.0,) * len(TERMS)
RIDGE = 0.01  # how strongly `calibrate` holds a term that the samples barely tell apart at the overall ratio
MULTIPLIER_RANGE = 10.0  # a fitted term stays within this factor of the overall measured/predicted ratio
COMM_OVERLAP = 0.7  # share of gradient/parameter collectives hidden behind compute
OFFLOAD_OVERLAP = 0.5  # share of host copies hidden behind compute
ACTIVATION_OFFLOAD_CPU_S_PER_BYTE = 2e-11  # CPU "offload": no copy, but the pack/unpack hooks run


@dataclass(frozen=True)
class Workload:
    """What one optimizer step of one rank computes and moves (from the model shape and the recipe)."""

    numel: int  # parameters
    block_numel: int  # parameters inside the blocks (what a recompute runs again)
    num_blocks: int
    hidden: int
    seq_len: int
    rows_per_step: int  # sequences per rank per step
    world_size: int
    head_numel: int = 0  # the output head's weight (a chunked loss recomputes its forward)
    trained_tensors: int = 0  # parameter tensors the optimizer steps
    reference_forwards: int = 0  # forwards of a frozen copy of the model per row (a DPO reference)
    grad_clip: float | None = None  # train.grad_clip (clipping in backward runs a step's passes twice)


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one step by term; `scale`: the multipliers they were scaled by, `model`: the
    model whose probe they were fitted to ("" for none)."""

    compute: float
    recompute: float
    micro_steps: float
    optimizer: float
    communication: float
    offload: float
    scale: tuple[float, ...] = field(default=UNCALIBRATED, compare=False)
    model: str = field(default="", compare=False)
    # the compile speedup the compiled terms were divided by (1.0: eager, or nothing learned)
    speedup: float = field(default=1.0, compare=False)

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.recompute
            + self.micro_steps
            + self.optimizer
            + self.communication
            + self.offload
        )

    def terms(self) -> tuple[float, ...]:
        return (
            self.compute,
            self.recompute,
            self.micro_steps,
            self.optimizer,
            self.communication,
            self.offload,
        )

    @classmethod
    def from_terms(
        cls,
        terms: Sequence[float],
        scale: tuple[float, ...] = UNCALIBRATED,
        model: str = "",
        speedup: float = 1.0,
    ) -> StepCost:
        """A step from its seconds by term, in the order of `TERMS`."""
        compute, recompute, micro_steps, optimizer, communication, offload = terms
        return cls(compute, recompute, micro_steps, optimizer, communication, offload, scale, model, speedup)

    @property
    def calibrated(self) -> bool:
        return self.scale != UNCALIBRATED or self.speedup != 1.0

    def uncalibrated(self) -> StepCost:
        """The same step at the device class's rates, eager (each term divided by its multiplier, the
        compiled terms times the compile speedup)."""
        again = [self.speedup if term in COMPILED_TERMS else 1.0 for term in TERMS]
        return StepCost.from_terms(
            [t * s / k if k else 0.0 for t, s, k in zip(self.terms(), again, self.scale, strict=True)]
        )


@dataclass(frozen=True)
class CostModel:
    """The rates of one device class and per-term multipliers (1.0 until calibrated; `model`: the model
    whose probe they were fitted to, "" for none)."""

    speed: DeviceSpeed
    scale: tuple[float, ...] = UNCALIBRATED
    model: str = ""
    compile_speedup: float = 1.0  # eager over compiled seconds of the compiled terms, learned per device

    @classmethod
    def for_device(cls, device_type: str) -> CostModel:
        return cls(SPEEDS.get(device_type, SPEEDS["cuda"]))

    def step(
        self,
        w: Workload,
        plan: Plan,
        *,
        micro_tokens: int,
        micro_steps: int,
        state_bytes: int,
        offloaded_activation_bytes: int,
        device_type: str,
        host_bytes: int = 0,
    ) -> StepCost:
        """Seconds of one step of `plan`. `micro_tokens`: tokens of the largest micro-batch; `state_bytes`:
        weights + gradients + optimizer states of this rank on the device; `offloaded_activation_bytes`:
        what one micro-step's activation offload sends to the host; `host_bytes`: the states
        `sharding_offload` keeps on the host (`StateBytes.host`)."""
        s = self.speed
        tokens = w.rows_per_step * w.seq_len
        flops_per_token = 6 * w.numel + 12 * w.num_blocks * w.hidden * w.seq_len
        rate = s.matmul_flops[plan.precision.compute] * micro_tokens / (micro_tokens + s.half_speed_tokens)
        compute = tokens * flops_per_token / rate
        compute += (
            w.reference_forwards * tokens * (2 * w.numel + 4 * w.num_blocks * w.hidden * w.seq_len) / rate
        )
        forward_of_blocks = tokens * (2 * w.block_numel + 4 * w.num_blocks * w.hidden * w.seq_len) / rate
        recomputed = plan.checkpointing.checkpointed(w.num_blocks)
        recomputed_share = sum(recomputed) / max(w.num_blocks, 1)
        share = {"forward": 1.0, "elementwise": s.selective_recompute}.get(plan.checkpointing.recompute, 0.0)
        calls = micro_steps * sum(recomputed) if plan.checkpointing.recompute != "none" else 0
        matmuls_of_blocks = tokens * 2 * w.block_numel / rate
        recompute = (
            forward_of_blocks * share + matmuls_of_blocks * plan.checkpointing.recomputed_matmuls
        ) * recomputed_share + calls * s.checkpoint_call_s
        if plan.loss.recomputes_head:
            recompute += tokens * 2 * w.head_numel / rate
        factor = plan.update_states.relative_step_cost.get(device_type, 1.0)
        optimizer = 2 * state_bytes / s.memory_bandwidth * factor
        if plan.optimizer_step.in_backward:
            optimizer += w.trained_tensors * s.tensor_step_s
        communication = self._communication(w, plan, micro_steps) * (1 - COMM_OVERLAP)
        offload = self._offload(offloaded_activation_bytes * micro_steps, device_type)
        if host_bytes:
            passes = micro_steps if plan.sharding.offload == "params" else 1
            offload += 2 * host_bytes * passes / s.host_link * (1 - OFFLOAD_OVERLAP)
            offload += 2 * host_bytes / s.host_step_bandwidth
        passes = plan.optimizer_step.passes(w.grad_clip)  # clipped in backward: a norm pass first
        raw = StepCost(
            passes * compute,
            passes * recompute,
            passes * micro_steps * s.micro_step_s,
            optimizer,
            communication,
            offload,
        )
        speedup = self.compile_speedup if plan.compile.compiled else 1.0
        sped = [speedup if term in COMPILED_TERMS else 1.0 for term in TERMS]
        scaled = [t * k / s for t, k, s in zip(raw.terms(), self.scale, sped, strict=True)]
        return StepCost.from_terms(scaled, self.scale, self.model, speedup)

    def _communication(self, w: Workload, plan: Plan, micro_steps: int) -> float:
        sharding = plan.sharding
        if w.world_size <= 1:
            return 0.0
        ring = (w.world_size - 1) / w.world_size
        grad_bytes = w.numel * plan.precision.stored_dtype.itemsize
        gather_bytes = w.numel * (4 if plan.precision.compute == "fp32" else 2)
        reduce = {"all-reduce": 2 * ring * grad_bytes, "reduce-scatter": ring * grad_bytes}.get(
            sharding.gradient_sync, 0.0
        ) * sharding.reductions_per_step(micro_steps)
        per_step, per_micro_step = sharding.parameter_gathers
        return (
            reduce + (per_step + micro_steps * per_micro_step) * ring * gather_bytes
        ) / self.speed.interconnect

    def _offload(self, activation_bytes: int, device_type: str) -> float:
        if device_type == "cuda":
            seconds = 2 * activation_bytes / self.speed.host_link
        else:
            seconds = activation_bytes * ACTIVATION_OFFLOAD_CPU_S_PER_BYTE
        return seconds * (1 - OFFLOAD_OVERLAP)


def calibrate(model: CostModel, samples: Sequence[tuple[StepCost, float]]) -> CostModel:
    """`model` with per-term multipliers fitted to measured seconds (each sample: a predicted step, at
    whatever multipliers it was predicted with, and the seconds it took).

    The fit minimises the squared *relative* error of the samples (a 10 ms step counts as much as a 1 s
    one), with a ridge that pulls each multiplier towards the overall ratio measured/predicted in
    proportion to how much the samples exercise its term: one sample rescales every term by that ratio,
    samples of plans that differ in a term (checkpointing, micro-batches) tell that term apart. A term no
    sample exercises gets the overall ratio; every multiplier stays within `MULTIPLIER_RANGE` of it."""
    if not samples:
        return model
    raw = np.array([c.uncalibrated().terms() for c, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    if (seconds <= 0).any() or (raw.sum(axis=1) <= 0).any():
        raise ValueError("calibrate: every sample needs a positive predicted and measured time")
    relative = raw / seconds[:, None]  # a row times the multipliers is predicted/measured: 1 when exact
    # the one multiplier for every term that fits best on average
    ratio = float(len(seconds) / relative.sum())
    ridge = RIDGE * (relative**2).sum(axis=0)
    ridge = ridge + (ridge == 0)  # a term no sample exercises: held at the ratio
    lhs = relative.T @ relative + np.diag(ridge)
    rhs = relative.T @ np.ones(len(seconds)) + ridge * ratio
    fitted = np.clip(np.linalg.solve(lhs, rhs), ratio / MULTIPLIER_RANGE, ratio * MULTIPLIER_RANGE)
    return replace(model, scale=tuple(float(k) for k in fitted))
