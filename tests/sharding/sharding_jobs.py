"""Training jobs for the sharding tests, run in sequence inside one process group.

Why one launch for many jobs: a torchrun launch costs 6-8 s on the 2-core CI machine, so the 2-rank
checks (parity of every mode, accumulation, bytes, resume) run as jobs of one launch:
`torchrun --nproc_per_node=2 tests/sharding/sharding_jobs.py SPEC.json OUT.json`. Each job trains
the tiny recipe of tests/helpers.py with its own overrides and reports its losses, the full fp32
weights after training (written by rank 0), and each rank's measured and estimated state bytes.
The same `run_job` runs single-rank jobs inside pytest.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memtrain.causal_lm.recipe import CausalLMRecipe  # noqa: E402
from memtrain.strategies.blocks import model_shape  # noqa: E402
from memtrain.strategies.sharding.deepspeed_backend import DeepSpeedBackend  # noqa: E402

from census import CensusTrainer  # noqa: E402
from helpers import tiny_recipe_dict  # noqa: E402


def full_weights(trainer: CensusTrainer) -> dict[str, torch.Tensor]:
    """Every weight, whole and fp32 (DeepSpeed: its fp32 master copy). Collective."""
    module = trainer.sharding.unwrap(trainer.model)  # type: ignore[arg-type]
    out = {}
    for name, p in module.named_parameters():
        if isinstance(trainer.sharding, DeepSpeedBackend):
            from deepspeed.utils import safe_get_full_fp32_param

            value = safe_get_full_fp32_param(p)
        elif isinstance(p, DTensor):
            value = p.full_tensor()
        else:
            value = p
        out[name] = value.detach().float().cpu().clone()
    return out


def estimates(trainer: CensusTrainer) -> list[dict[str, int]]:
    """`state_bytes` for every rank, from the unwrapped model's shape (with the plan's adapters: a LoRA
    base frozen)."""
    model = trainer.build_model()
    assert trainer.plan is not None
    trainer.plan.adapters.apply(model)
    shape = model_shape(model, trainer.blocks(model))
    dim0 = {name: p.shape[0] for name, p in model.named_parameters() if p.dim() > 0}
    world = trainer.env.world_size
    return [
        dataclasses.asdict(trainer.sharding.state_bytes(shape, world, dim0=dim0, rank=r))
        for r in range(world)
    ]


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train one job; returns losses, seconds, measured and estimated bytes and the tracked peaks (all
    ranks) on every rank."""
    recipe = CausalLMRecipe.from_dict(tiny_recipe_dict(Path(job["run_dir"]), **job.get("sections", {})))
    trainer = CensusTrainer(recipe)
    result = trainer.fit(resume=job.get("resume"))
    if job.get("weights_out"):  # every rank has the same jobs: the gathers are collective
        weights = full_weights(trainer)
        if trainer.env.is_main:
            torch.save(weights, job["weights_out"])
    census = dataclasses.asdict(trainer.census) if trainer.census is not None else None
    reports = trainer.monitor.memory_reports  # `memory.track`: the tracker's peak of the last step
    mine = (census, reports[-1].peak_bytes if reports else None)
    if trainer.env.distributed:
        gathered: list[Any] = [None] * trainer.env.world_size
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    out = {
        "losses": result.losses,
        "seconds": result.summary["seconds"],
        "census": [c for c, _ in gathered],
        "peak": [p for _, p in gathered],
        "estimate": estimates(trainer),
        "world_size": trainer.env.world_size,
    }
    del trainer
    gc.collect()
    return out


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    results = {job["name"]: run_job(job) for job in spec["jobs"]}
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
