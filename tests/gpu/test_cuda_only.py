"""What only a CUDA device can check: real fp8 training, paged 8-bit optimizer states, `memtrain profile`'s
memory_viz snapshot and allocator view, the allocator model replayed over a profiled run's own requests, and
the planner's prediction (allocated and reserved) against the allocator.

Why here: the CPU suite covers these paths through emulation (fp8_emulate), the non-paged 8-bit optimizer
and the tracker; what they cannot show is the CUDA kernels and the caching allocator. Every test is marked
`gpu` (`pytest -m gpu`, run by scripts/gpu_check.sh) and skips on a machine without CUDA, with the reason.
The other `gpu` tests live beside their CPU counterparts: activation-offload streams in
tests/strategies/test_checkpointing.py, allocator statistics and memory history in
tests/memory/test_cuda_stats.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.memory.footprint import Footprint
from memtrain.strategies.blocks import discover_blocks, model_shape
from memtrain.strategies.optimizer import OPTIMIZER_STATES, measured_state_bytes

from helpers import subprocess_env, tiny_recipe, tiny_recipe_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Dimensions divisible by 16 (fp8 matmuls need it) and tensors on both sides of bitsandbytes' 8-bit
# threshold (4096 elements); fixed-length rows so every fp8 matmul has a multiple of 16 rows.
MODEL: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 64,
}
SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": MODEL},
    "data": {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 256, "min_len": 0}},
    "batch": {"global_size": 8, "micro_size": 4},
}
# fp8's final loss against bf16-mixed's after 40 steps: a first bound, to tighten once measured on GPUs.
FP8_FINAL_LOSS_TOLERANCE = 0.10
# A model whose peak (~0.5 GiB) dwarfs cuBLAS's workspaces (tens of MiB, held by the caching allocator),
# for the planner's prediction against max_memory_allocated. The bound is loose on purpose: it catches a
# gross error on CUDA; scripts/estimator_accuracy.py measures the real error (goal 5%) on a 134M model.
PLANNER_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {
        "config": {
            **MODEL,
            "hidden_size": 512,
            "intermediate_size": 1408,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "vocab_size": 8192,
            "max_position_embeddings": 256,
        }
    },
    "data": {"source": "synthetic", "seq_len": 256, "synthetic": {"num_samples": 64, "min_len": 0}},
}
PLANNER_TOLERANCE = 0.25
# The allocator model over the requests of a real run (issue 29's goal for reserved bytes: within 5%).
RESERVED_TOLERANCE = 0.05


def has_fp8() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability() >= (8, 9)
        and importlib.util.find_spec("torchao") is not None
    )


@pytest.mark.skipif(not has_fp8(), reason="needs compute capability >= 8.9 and torchao")
def test_fp8_trains_on_cuda_like_bf16(tmp_path: Path) -> None:
    from torchao.float8.float8_linear import Float8Linear

    train = {"train": {"steps": 40, "lr": 1e-2}}
    reference = (
        CausalLMTrainer(
            tiny_recipe(tmp_path / "bf16", **SECTIONS, **train, strategies={"precision": "bf16-mixed"})
        )
        .fit()
        .losses
    )
    trainer = CausalLMTrainer(
        tiny_recipe(tmp_path / "fp8", **SECTIONS, **train, strategies={"precision": "fp8"})
    )
    trainer.setup()
    swapped = [m for m in trainer.model.modules() if isinstance(m, Float8Linear)]
    assert len(swapped) == 2 * 7 and not any(m.config.emulate for m in swapped), "real fp8 kernels"
    losses = trainer.fit().losses
    assert losses[-1] < 0.85 * losses[0]
    assert abs(losses[-1] - reference[-1]) / reference[-1] < FP8_FINAL_LOSS_TOLERANCE, (
        losses[-1],
        reference[-1],
    )


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_paged_8bit_trains_on_cuda_and_matches_its_estimate(tmp_path: Path) -> None:
    trainer = CausalLMTrainer(
        tiny_recipe(
            tmp_path,
            **SECTIONS,
            train={"steps": 20, "lr": 1e-2},
            strategies={"optimizer_states": "paged-8bit"},
        )
    )
    trainer.setup()
    assert type(trainer.optimizer).__name__ == "PagedAdamW8bit"
    losses = trainer.fit().losses
    assert losses[-1] < 0.9 * losses[0]
    model = trainer.model
    estimate = OPTIMIZER_STATES.create("paged-8bit").estimate(
        model_shape(model, discover_blocks(model)), Footprint()
    )
    assert estimate.optimizer_states == measured_state_bytes(trainer.optimizer)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_paged_states_are_outside_the_allocator() -> None:
    """`paged-8bit`'s moments of large tensors are CUDA unified memory: torch's allocator holds only the
    rest (`state_bytes - paged_bytes`: absmax blocks, maps, small tensors' states), what the planner's device
    levels count (each allocation rounded up to the allocator's 512-byte blocks)."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 64)).cuda().to(torch.bfloat16)
    states = OPTIMIZER_STATES.create("paged-8bit")
    optimizer = states.build(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    optimizer.step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    shape = model_shape(model, [])
    device_part = states.state_bytes(shape, 2) - states.paged_bytes(shape)
    assert states.paged_bytes(shape) == 2 * 512 * 512  # the one tensor of at least 100k elements
    assert device_part <= held <= device_part + 512 * 4 * len(shape.params), (held, device_part)


def test_profile_on_cuda_writes_a_memory_viz_snapshot_and_the_allocator_view(tmp_path: Path) -> None:
    from memtrain.commands.profile import run_profile

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(tiny_recipe_dict(tmp_path, **SECTIONS, strategies={"precision": "bf16-mixed"}))
    )
    report, out = run_profile(str(recipe), [], steps=2, out=tmp_path / "profile")
    snapshot = out / "memory_snapshot.pickle"
    assert snapshot.is_file() and snapshot.stat().st_size > 0
    assert report["device"].startswith("cuda")
    allocator = report["cuda"]["allocator"]
    assert allocator["peak_reserved_bytes"] >= allocator["peak_allocated_bytes"] > 0
    assert report["cuda"]["context_bytes"] > 0
    # The allocator's peak is the last step's (it is reset every step). The tracker counts that step's
    # tensor storages; the allocator holds those, rounded up, plus kernel workspaces.
    assert report["steps"][-1]["peak_bytes"] <= allocator["peak_allocated_bytes"]


def test_the_allocator_model_replays_a_profiled_run_to_what_the_allocator_reserved(tmp_path: Path) -> None:
    # In a process of its own: the replay starts from an empty allocator, which this one is not by now; with
    # the step-time cache on, as a user's run has it (the probe's empty_cache is in the history then).
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(tiny_recipe_dict(tmp_path, **PLANNER_SECTIONS, strategies={"precision": "bf16-mixed"}))
    )
    out = tmp_path / "profile"
    done = subprocess.run(
        [sys.executable, "-m", "memtrain", "profile", str(recipe), "--steps", "3", "--out", str(out)],
        env={**subprocess_env(), "MEMTRAIN_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    check = json.loads((out / "memory.json").read_text())["cuda"]["allocator_model"]
    print(next(line for line in done.stdout.splitlines() if line.startswith("allocator model:")))
    assert check["reason"] is None, check["reason"]
    assert check["replayed_allocated_bytes"] == check["allocated_bytes"], check  # every request read right
    error = (check["replayed_reserved_bytes"] - check["reserved_bytes"]) / check["reserved_bytes"]
    assert abs(error) <= RESERVED_TOLERANCE, check


def test_planner_prediction_against_the_allocator(tmp_path: Path) -> None:
    from memtrain.distributed import init_distributed
    from memtrain.planner import plan_for_run

    auto = tiny_recipe(
        tmp_path / "auto",
        **PLANNER_SECTIONS,
        batch={"global_size": 8, "micro_size": "auto"},
        strategies={
            "precision": "auto",
            "checkpointing": "auto",
            "optimizer_states": ["fp32"],
            "sharding": "auto",
        },
    )
    result = plan_for_run(
        auto, init_distributed(), CausalLMTrainer(auto).model_spec(), progress=lambda _line: None
    )
    assert result.plan.precision.name in ("bf16-mixed", "fp32"), "auto keeps fp32-like numerics"
    assert result.chosen is not None
    plan = result.plan
    sections = {**PLANNER_SECTIONS, "batch": {"global_size": 8, "micro_size": plan.micro_batch_size}}
    pinned = tiny_recipe(
        tmp_path / "run",
        **sections,
        train={"steps": 3},
        strategies={
            "precision": plan.precision.name,
            "checkpointing": plan.checkpointing.name,
            "checkpointing_fraction": getattr(plan.checkpointing, "fraction", 0.5),
            "optimizer_states": plan.optimizer_states.name,
        },
    )
    trainer = CausalLMTrainer(pinned)
    torch.cuda.empty_cache()
    trainer.fit()
    predicted, measured = result.chosen.prediction.peak, trainer.monitor.max_step_peak
    assert abs(predicted - measured) / measured < PLANNER_TOLERANCE, (predicted, measured)
    # Reserved bytes (the caching-allocator model replayed over the traced step, planner/reserved.py)
    # against what the allocator reserved: segments are never returned without empty_cache, so what it
    # holds after the run is its peak. Printed for docs/BENCHMARKS.md (`pytest -m gpu -s`).
    reserved, held = result.chosen.prediction.reserved, torch.cuda.memory_reserved()
    print(
        f"reserved: predicted {reserved}, measured {held} (max_memory_reserved {torch.cuda.max_memory_reserved()})"
    )
    assert reserved is not None and abs(reserved - held) / held < PLANNER_TOLERANCE, (reserved, held)
