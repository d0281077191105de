"""Step-time model: which of the plans that fit is fastest. Every constant of the model is in this file.

The planner needs a ranking, not a stopwatch, so the model is a handful of terms with physical meaning,
each a count (FLOPs, bytes) divided by a rate:

- compute: 6 FLOPs per parameter per token plus attention (12·L·h·s per token), at the precision's matmul
  rate, slowed by small micro-batches: a micro-batch of t tokens runs at t / (t + t_half) of full speed;
- recompute: checkpointed blocks run their forward again (`full`/`fraction`: all of it; `selective`:
  a device-dependent share);
- a fixed cost per micro-step (kernel launches, Python, hooks), which makes accumulation cost something;
- the optimizer step: bytes of weights, gradients and states it streams, at device-memory bandwidth, times
  a factor for the state format (dequantising 8-bit states costs more than fp32 AdamW);
- communication: gradient all-reduce (ddp, zero1), reduce-scatter and all-gathers (zero2/zero3, per
  micro-step for the gathers) over the interconnect, partly hidden behind compute;
- offload: activations (checkpointing `offload`) or states (`sharding_offload`) over the host link.

Rates are those of a device class (`SPEEDS`); `calibrate` rescales the terms from measured step times
(probe steps on the device, or the CPU benchmark in scripts/bench_plan_quality.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class DeviceSpeed:
    matmul_flops: dict[str, float]  # achievable dense FLOP/s per precision
    half_speed_tokens: float  # micro-batch tokens at which compute runs at half its full-batch speed
    micro_step_s: float  # fixed cost of one micro-step
    memory_bandwidth: float  # device memory, bytes/s
    host_link: float  # device <-> host, bytes/s
    interconnect: float  # per-rank collective bandwidth, bytes/s
    selective_recompute: float  # `selective`: recompute time as a share of the blocks' forward
    checkpoint_call_s: float  # fixed cost of one checkpointed block per micro-step (RNG state, hooks)
    optimizer_factor: dict[str, float]  # optimizer time per byte streamed, relative to fp32 AdamW


SPEEDS: dict[str, DeviceSpeed] = {
    # H100-class: ~60% of 989 TFLOP/s bf16 dense; fp32 without TF32 at ~50 TFLOP/s; HBM3 3.35 TB/s;
    # PCIe 5 x16 ~50 GB/s; NVLink 4 ~300 GB/s effective per rank for ring collectives. Selective
    # recompute redoes only elementwise work (the playbook: ~3% of compute on GPT-3); bitsandbytes'
    # fused 8-bit kernels stream fewer bytes at about the same rate.
    "cuda": DeviceSpeed(
        matmul_flops={"fp32": 50e12, "bf16-mixed": 600e12, "bf16-master": 600e12, "fp16-mixed": 600e12,
                      "fp8": 900e12},
        half_speed_tokens=512.0, micro_step_s=3e-3, memory_bandwidth=3.0e12, host_link=50e9,
        interconnect=300e9, selective_recompute=0.1, checkpoint_call_s=2e-4,
        optimizer_factor={"fp32": 1.0, "bf16": 1.6, "8bit": 1.2, "paged-8bit": 1.4},
    ),
    # One thread of this 2-core CPU, measured (min of 3 runs of 8 steps, a 1.3M-parameter llama at
    # 2k tokens per step): ~130 GFLOP/s fp32 from 128 tokens up, 3 ms per micro-step, 1.3 ms per
    # checkpointed block call; torch's selective checkpointing runs its policy per op and costs a little
    # more than recomputing the whole block here; the bf16-state and 8-bit optimizers are 3x and 7x slower
    # per byte than fp32 AdamW. bf16 autocast is slower than fp32 on this CPU.
    "cpu": DeviceSpeed(
        matmul_flops={"fp32": 130e9, "bf16-mixed": 50e9, "bf16-master": 50e9, "fp16-mixed": 25e9, "fp8": 5e9},
        half_speed_tokens=8.0, micro_step_s=3e-3, memory_bandwidth=5e9, host_link=5e9, interconnect=2e9,
        selective_recompute=1.3, checkpoint_call_s=1.3e-3,
        optimizer_factor={"fp32": 1.0, "bf16": 3.2, "8bit": 6.6, "paged-8bit": 6.6},
    ),
}
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


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one step by term."""

    compute: float
    recompute: float
    micro_steps: float
    optimizer: float
    communication: float
    offload: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.micro_steps + self.optimizer + self.communication + self.offload

    def terms(self) -> tuple[float, ...]:
        return (self.compute, self.recompute, self.micro_steps, self.optimizer, self.communication, self.offload)


@dataclass(frozen=True)
class CostModel:
    """The rates of one device class and per-term multipliers (1.0 until calibrated)."""

    speed: DeviceSpeed
    scale: tuple[float, ...] = (1.0,) * 6

    @classmethod
    def for_device(cls, device_type: str) -> CostModel:
        return cls(SPEEDS.get(device_type, SPEEDS["cuda"]))

    def step(self, w: Workload, *, precision: str, checkpointing: str, recomputed_share: float,
             optimizer_states: str, sharding: str, sharding_offload: str, micro_tokens: int,
             micro_steps: int, state_bytes: int, offloaded_activation_bytes: int,
             device_type: str) -> StepCost:
        """Seconds of one step. `recomputed_share`: checkpointed blocks / all blocks; `state_bytes`:
        weights + gradients + optimizer states of this rank; `offloaded_activation_bytes`: what one
        micro-step's checkpointing offload sends to the host."""
        s = self.speed
        tokens = w.rows_per_step * w.seq_len
        flops_per_token = 6 * w.numel + 12 * w.num_blocks * w.hidden * w.seq_len
        rate = s.matmul_flops[precision] * micro_tokens / (micro_tokens + s.half_speed_tokens)
        compute = tokens * flops_per_token / rate
        forward_of_blocks = tokens * (2 * w.block_numel + 4 * w.num_blocks * w.hidden * w.seq_len) / rate
        share = s.selective_recompute if checkpointing == "selective" else float(checkpointing != "offload")
        calls = micro_steps * round(recomputed_share * w.num_blocks)
        recompute = forward_of_blocks * recomputed_share * share + calls * s.checkpoint_call_s
        optimizer = 2 * state_bytes / s.memory_bandwidth * s.optimizer_factor[optimizer_states]
        communication = self._communication(w, sharding, precision, micro_steps) * (1 - COMM_OVERLAP)
        offload = self._offload(offloaded_activation_bytes * micro_steps, device_type, state_bytes, sharding_offload)
        raw = StepCost(compute, recompute, micro_steps * s.micro_step_s, optimizer, communication, offload)
        return StepCost(*(t * k for t, k in zip(raw.terms(), self.scale, strict=True)))

    def _communication(self, w: Workload, sharding: str, precision: str, micro_steps: int) -> float:
        if w.world_size <= 1 or sharding == "none":
            return 0.0
        ring = (w.world_size - 1) / w.world_size
        grad_bytes = w.numel * (2 if precision == "bf16-master" else 4)
        gather_bytes = w.numel * (4 if precision == "fp32" else 2)
        if sharding in ("ddp", "zero1"):
            moved = 2 * ring * grad_bytes + (ring * gather_bytes if sharding == "zero1" else 0)
        else:
            gathers = 1 if sharding == "zero2" else 2  # zero3 gathers again for backward
            moved = ring * grad_bytes + micro_steps * gathers * ring * gather_bytes
        return moved / self.speed.interconnect

    def _offload(self, activation_bytes: int, device_type: str, state_bytes: int, sharding_offload: str) -> float:
        if device_type == "cuda":
            seconds = 2 * activation_bytes / self.speed.host_link
        else:
            seconds = activation_bytes * ACTIVATION_OFFLOAD_CPU_S_PER_BYTE
        if sharding_offload != "none":
            seconds += 2 * state_bytes / self.speed.host_link
        return seconds * (1 - OFFLOAD_OVERLAP)


def calibrate(model: CostModel, samples: list[tuple[StepCost, float]]) -> CostModel:
    """Per-term multipliers fitted (least squares, non-negative) to measured step seconds.

    Terms that no sample exercises keep their multiplier; the fit starts from the current one."""
    if not samples:
        return model
    terms = np.array([c.terms() for c, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    used = terms.any(axis=0)
    solution, *_ = np.linalg.lstsq(terms[:, used], seconds, rcond=None)
    scale = list(model.scale)
    for index, value in zip(np.flatnonzero(used), solution, strict=True):
        scale[index] = max(float(value), 0.0) * model.scale[index] if value > 0 else model.scale[index]
    return replace(model, scale=tuple(scale))
