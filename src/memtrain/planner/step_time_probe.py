"""A timed probe of the model being planned: its real forward and backward on the device, at two
micro-batch sizes, in about a second, before the search.

Why: how many seconds a model spends per FLOP depends on the model as much as on the machine: on the
2-core CPU a tiny gpt2 (dropout, tanh GELU, biased LayerNorms) takes about 1.8x the seconds per FLOP of a
llama of the same size, which a count of FLOPs cannot see, and multipliers fitted to other models' runs
carry their models' factors (scripts/bench_step_time.py). The probe measures this model, so the first plan
of a new model is calibrated too (step_time_calibration.py fits the multipliers to it).

What it runs: the trainer's own model and `loss` on its `micro_batch(rows)`, in fp32, in training mode
(dropout on), with the recipe's adapters (only they get gradients), and an AdamW step with gradient
clipping over what trains (the optimizer term). A model built with its parameters on the meta device (a
pretrained model before its weights load) gets random values: the probe times kernels, not weights. A
clone with `PROBE_BLOCKS` blocks stands for a deeper model when the trainer can build one, so the probe
needs little memory; without a clone the whole model runs, and only when its fp32 weights and
gradients take at most `BUDGET_SHARE` of the usable budget (otherwise there is no probe, and nothing fails:
the probe only ever makes a prediction better).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from dataclasses import replace

import torch
from torch import nn

from memtrain.plan import Plan
from memtrain.planner.cost import CostModel, StepCost, Workload
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.spec import loss_output
from memtrain.strategies.checkpointing import NoCheckpointing
from memtrain.strategies.micro_batching import MicroBatching
from memtrain.strategies.optimizer import OptimizerStates
from memtrain.strategies.precision import Precision
from memtrain.strategies.sharding import Sharding

PROBE_BLOCKS = 2
ROWS = (1, 4)  # micro-batch sizes timed: the fixed cost of a micro-step and the compute rate
REPEATS = 5  # timed passes per size (after one untimed): the median counts
BUDGET_SHARE = 0.25  # the most of the usable budget the probe's fp32 weights and gradients may take
CLOCK = time.perf_counter  # wall-clock seconds, as the trainer times steps (a benchmark may swap it)


def fingerprint(probe: ModelProbe) -> str:
    """What a cached probe is keyed by within a device: the model's shape and the planned sequence."""
    names = hashlib.sha256("\n".join(p.name for p in probe.shape.params).encode()).hexdigest()[:12]
    return (
        f"{probe.spec.name}: {probe.shape.numel} parameters ({names}), {probe.num_blocks} blocks, hidden "
        f"{probe.hidden_size}, {probe.seq_len} tokens per row"
    )


def time_model(
    probe: ModelProbe, device: torch.device, usable_bytes: int
) -> list[tuple[str, StepCost, float]]:
    """Forward and backward of the model (or its clone) at each of `ROWS`, then its optimizer step (AdamW
    after clipping the gradients, as the trainer steps): (what was timed, what the cost model predicts for
    it at the device class's rates, the median seconds measured). Empty when the model is too large to
    probe here or the probe fails (a line on stderr says why)."""
    spec = probe.spec
    depth = min(PROBE_BLOCKS, probe.num_blocks)
    use_clone = spec.build_clone is not None and not probe.whole_model and depth < probe.num_blocks
    if not use_clone and 8 * probe.shape.numel > BUDGET_SHARE * usable_bytes:
        return []
    seed = torch.random.get_rng_state()
    try:
        with torch.device(device):
            model = (
                spec.build_clone(depth) if use_clone and spec.build_clone is not None else spec.build_model()
            )
        _materialise(model, device)
        model.to(device=device, dtype=torch.float32).train()
        probe.adapters.apply(model)  # the run's job: a frozen base, only the adapters stepped
        passes = [
            (
                f"probe, {rows} rows",
                _predicted(probe, model, rows, device.type),
                _seconds(probe, model, rows, device),
            )
            for rows in ROWS
        ]
        step = _predicted(probe, model, 1, device.type, optimizer=True)
        return [*passes, ("probe, optimizer step", step, _optimizer_seconds(model, device))]
    except Exception as exc:  # out of memory, a model that does not train in fp32: no probe, no harm
        first = (str(exc).splitlines() or [""])[0][:200]
        print(
            f"[memtrain] step-time probe skipped ({type(exc).__name__}: {first})", file=sys.stderr, flush=True
        )
        return []
    finally:
        torch.random.set_rng_state(seed)  # the run's initialisation does not depend on whether it probed
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Random values on `device` for the tensors `model` holds on the meta device (a pretrained model
    before its weights load): the probe times the kernels, not the weights. Shared (tied) parameters stay
    shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in named:
            if not tensor.is_meta:
                continue
            if id(tensor) not in made and isinstance(tensor, nn.Parameter):
                values = torch.empty(tensor.shape, device=device).normal_(0.0, 0.02)
                made[id(tensor)] = nn.Parameter(values, tensor.requires_grad)
            elif id(tensor) not in made:  # a buffer keeps its dtype (position ids, masks)
                made[id(tensor)] = torch.zeros(tensor.shape, device=device, dtype=tensor.dtype)
            setattr(module, name, made[id(tensor)])


def _seconds(probe: ModelProbe, model: nn.Module, rows: int, device: torch.device) -> float:
    batch = {k: v.to(device) for k, v in probe.spec.micro_batch(rows).items()}
    times = []
    for _ in range(REPEATS + 1):
        _synchronize(device)
        started = CLOCK()
        loss, _ = loss_output(probe.spec.loss(model, batch))
        loss.backward()
        _synchronize(device)
        times.append(CLOCK() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _optimizer_seconds(model: nn.Module, device: torch.device) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = torch.optim.AdamW(params, lr=0.0)  # the model is thrown away: only the time counts
    times = []
    for _ in range(REPEATS + 1):  # the first step creates the states
        _synchronize(device)
        started = CLOCK()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        _synchronize(device)
        times.append(CLOCK() - started)
    return statistics.median(times[1:])


def _predicted(
    probe: ModelProbe, model: nn.Module, rows: int, device_type: str, optimizer: bool = False
) -> StepCost:
    """The cost model's forward and backward of `rows` rows, or (`optimizer`) its fp32 AdamW step alone."""
    blocks = probe.spec.blocks(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    workload = Workload(
        numel=sum(p.numel() for p in model.parameters()),
        block_numel=sum(p.numel() for b in blocks for p in b.parameters()),
        num_blocks=len(blocks),
        hidden=probe.hidden_size,
        seq_len=probe.seq_len,
        rows_per_step=rows,
        world_size=1,
    )
    plan = Plan(Precision(), NoCheckpointing(), OptimizerStates(), Sharding(), MicroBatching(rows, 1))
    step = CostModel.for_device(device_type).step(
        workload,
        plan,
        micro_tokens=rows * probe.seq_len,
        micro_steps=1,
        # fp32 weights; gradients and two AdamW moments of what trains
        state_bytes=4 * workload.numel + 12 * sum(p.numel() for p in trained),
        offloaded_activation_bytes=0,
        device_type=device_type,
    )
    if optimizer:
        return StepCost(0.0, 0.0, 0.0, step.optimizer, 0.0, 0.0)
    return replace(step, optimizer=0.0)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
