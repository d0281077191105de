"""`strategies.gradient_reduction`: when zero2/zero3 reduce gradients under accumulation.

- FSDP2 `per_micro_step` on 2 gloo ranks trains like one process (fp32: the same micro-step gradients
  summed in another order, `REDUCTION_ORDER` as in test_two_ranks.py), also with parameter offload, and keeps no
  unsharded gradient between micro-steps, where `per_step` keeps one of the whole model: both measured
  (FSDP2's per-parameter state at the start of each micro-step) equal to `state_bytes`' gradient copies.
- DeepSpeed does what its stage does (ZeRO-1 per step, ZeRO-2/3 per micro-step); the other is refused.
- The planner takes `per_micro_step` only when the unsharded gradient does not fit (it costs a
  reduce-scatter per micro-step).

This file is also the 2-rank job script: `torchrun --nproc_per_node=2 test_gradient_reduction.py SPEC OUT`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sharding_jobs import estimates, full_weights, run_job  # noqa: E402

from memtrain.causal_lm.recipe import CausalLMRecipe  # noqa: E402
from memtrain.distributed import DistEnv  # noqa: E402
from memtrain.errors import Unsupported  # noqa: E402
from memtrain.memory.headroom import Target, budget_from  # noqa: E402
from memtrain.planner.search import search  # noqa: E402
from memtrain.strategies.sharding import make_sharding  # noqa: E402
from memtrain.training.trainer import Batch  # noqa: E402

from census import CensusTrainer, storage_bytes  # noqa: E402
from helpers import (  # noqa: E402
    assert_trained_alike,
    initial_weights,
    probe_of,
    run_two_ranks,
    tiny_recipe,
    tiny_recipe_dict,
)

STEPS = {"train": {"steps": 3}, "batch": {"global_size": 8, "micro_size": 2}}  # 2 micro-steps per rank
JOBS = {
    "zero2-micro": {"sharding": "zero2", "gradient_reduction": "per_micro_step"},
    "zero3-micro": {"sharding": "zero3", "gradient_reduction": "per_micro_step"},
    "zero3-micro-offload": {
        "sharding": "zero3",
        "gradient_reduction": "per_micro_step",
        "sharding_offload": "params",
    },
    "zero3-step": {"sharding": "zero3", "gradient_reduction": "per_step"},
}


def unsharded_gradient_bytes(model: nn.Module) -> int:
    """Bytes of the unsharded gradients FSDP2 holds (private per-parameter state, as `discard_step` reads it)."""
    grads: list[torch.Tensor | None] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    grads.append(fsdp_param.unsharded_accumulated_grad)
                    if hasattr(fsdp_param, "_unsharded_param"):
                        grads.append(fsdp_param._unsharded_param.grad)
    return storage_bytes(grads)


class ReductionTrainer(CensusTrainer):
    """Also records the most unsharded-gradient bytes seen when a micro-step starts."""

    unsharded: int = 0

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        self.unsharded = max(self.unsharded, unsharded_gradient_bytes(model))
        return super().loss(model, batch)


def run_reduction_job(job: dict[str, Any]) -> dict[str, Any]:
    recipe = CausalLMRecipe.from_dict(tiny_recipe_dict(Path(job["run_dir"]), **job["sections"]))
    trainer = ReductionTrainer(recipe)
    result = trainer.fit()
    weights = full_weights(trainer)
    if trainer.env.is_main:
        torch.save(weights, job["weights_out"])
    unsharded: list[Any] = [None] * trainer.env.world_size
    dist.all_gather_object(unsharded, trainer.unsharded)
    return {"losses": result.losses, "unsharded": unsharded, "estimate": estimates(trainer)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reduction")
    reference = run_job(
        {"run_dir": str(root / "ref"), "weights_out": str(root / "ref.pt"), "sections": dict(STEPS)}
    )
    jobs = [
        {
            "name": name,
            "run_dir": str(root / name),
            "weights_out": str(root / f"{name}.pt"),
            "sections": {**STEPS, "strategies": strategies},
        }
        for name, strategies in JOBS.items()
    ]
    spec, out = root / "spec.json", root / "out.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    run_two_ranks(str(Path(__file__).resolve()), str(spec), str(out))
    initial = initial_weights(tiny_recipe(root / "initial", **STEPS))  # what every job started from
    return {"root": root, "ref": reference, "initial": initial, **json.loads(out.read_text())}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["zero2-micro", "zero3-micro", "zero3-micro-offload"])
def test_per_micro_step_trains_like_one_process(runs: dict[str, Any], name: str) -> None:
    assert runs[name]["losses"] == pytest.approx(runs["ref"]["losses"], rel=1e-5)
    expected = torch.load(runs["root"] / "ref.pt", weights_only=True)
    got = torch.load(runs["root"] / f"{name}.pt", weights_only=True)
    assert_trained_alike(got, expected, runs["initial"])  # sums in another order: helpers.REDUCTION_ORDER


@pytest.mark.distributed
def test_unsharded_gradient_only_per_step(runs: dict[str, Any], tmp_path: Path) -> None:
    for name in ("zero3-step", "zero3-micro"):
        estimated = [e["gradient_copies"] for e in runs[name]["estimate"]]
        assert runs[name]["unsharded"] == estimated, name
    numel = sum(p.numel for p in probe_of(tiny_recipe(tmp_path)).shape.params)
    assert runs["zero3-step"]["unsharded"] == [4 * numel] * 2  # the whole model's fp32 gradient, per rank
    assert runs["zero3-micro"]["unsharded"] == [0, 0]


@pytest.mark.parametrize(
    ("name", "options", "allowed"),
    [
        ("zero2", {"backend": "deepspeed", "gradient_reduction": "per_step"}, "per_micro_step"),
        ("zero3", {"backend": "deepspeed", "gradient_reduction": "per_step"}, "per_micro_step"),
        ("zero1", {"backend": "deepspeed", "gradient_reduction": "per_micro_step"}, "per_step"),
        ("ddp", {"gradient_reduction": "per_micro_step"}, "per_step"),
        ("zero1", {"gradient_reduction": "per_micro_step"}, "per_step"),
    ],
)
def test_a_reduction_the_backend_cannot_run_is_refused(
    name: str, options: dict[str, str], allowed: str
) -> None:
    backend = make_sharding(name, **options)
    with pytest.raises(Unsupported, match=f"strategies.gradient_reduction=.*{allowed}"):
        backend.check(DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu")))


def test_auto_is_what_each_backend_does() -> None:
    assert make_sharding("zero3").gradient_reduction == "per_step"  # fsdp2: no-sync accumulation
    assert make_sharding("zero2", backend="deepspeed").gradient_reduction == "per_micro_step"
    assert make_sharding("zero1", backend="deepspeed").gradient_reduction == "per_step"


def _plan(budget: int, tmp_path: Path) -> Any:
    recipe = tiny_recipe(
        tmp_path,
        batch={"global_size": 8, "micro_size": 2},
        strategies={"sharding": "zero3", "checkpointing": "none", "gradient_reduction": "auto"},
    )
    target = Target("cpu", 2, budget_from(budget, budget, 0, 0.0, "test"), bf16=True, fp8=False)
    return search(recipe, probe_of(recipe), target, torch.device("cpu"))


def test_planner_reduces_every_micro_step_only_when_the_unsharded_gradient_does_not_fit(
    tmp_path: Path,
) -> None:
    roomy = _plan(2**40, tmp_path)
    assert roomy.plan.sharding.gradient_reduction == "per_step"  # one reduce-scatter per step is cheaper
    by_reduction = {s.plan.sharding.gradient_reduction: s for s in roomy.ranked}
    per_step, per_micro_step = by_reduction["per_step"], by_reduction["per_micro_step"]
    assert per_micro_step.cost.communication > per_step.cost.communication
    numel = sum(p.numel for p in probe_of(tiny_recipe(tmp_path)).shape.params)
    assert (
        per_step.prediction.peak - per_micro_step.prediction.peak == 4 * numel
    )  # the unsharded fp32 gradient
    tight = _plan(per_step.prediction.peak - 1, tmp_path)
    assert tight.plan.sharding.gradient_reduction == "per_micro_step"


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    results = {job["name"]: run_reduction_job(job) for job in spec["jobs"]}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
