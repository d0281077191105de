"""The mesh planner against published 405B runs on paper (issue 25; ../shared/REFERENCE.md, torchtitan's
benchmarks): 1-D FSDP on 128 H100 runs out of memory where FSDP 16 x TP 8 trains, and interleaved 1F1B holds
less than 1F1B with torchtitan's default micro-batches (one per stage: 8 x 4 rows, 16 x 2 rows). One probe
of the 405B model serves every case (three traced micro-batch sizes of a three-block clone)."""

from __future__ import annotations

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.tensor_parallel import tensor_parallel_problems
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.planner.mesh_search import MeshResult, search_meshes
from memtrain.planner.model_probe import ModelProbe

from helpers import REPO, probe_of

RECIPE = REPO / "recipes/llama-405b.yaml"
PINNED = ["strategies.checkpointing=full", "strategies.sharding=zero3", "strategies.loss=standard"]


@pytest.fixture(scope="module")
def probe() -> ModelProbe:
    torch.set_num_threads(1)
    return probe_of(CausalLMRecipe.load(RECIPE, PINNED))


def _plan(probe: ModelProbe, world: int, *overrides: str) -> MeshResult:
    recipe = CausalLMRecipe.load(RECIPE, [*PINNED, *overrides])
    gpu = load_gpu("h100-96gb")
    config = recipe.model.config
    return search_meshes(
        recipe,
        lambda cp: probe,
        what_if_target(world, gpu, None, None),
        gpu.cluster,
        torch.device("cuda", 0),
        tensor_parallel_problems=lambda tp: tensor_parallel_problems(_Config(config), tp),
        pipeline=True,
    )


class _Config:
    """The recipe's model config as transformers' attributes (what tensor_parallel_problems reads)."""

    def __init__(self, values: dict[str, object]) -> None:
        self.__dict__.update(values)
        self.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise"}


def _mesh(**degrees: object) -> list[str]:
    return [f"strategies.mesh.{k}={v}" for k, v in degrees.items()]


@pytest.mark.slow
def test_405b_needs_tensor_parallelism_on_128_gpus(probe: ModelProbe) -> None:
    one_d = _plan(probe, 128, "batch.global_size=128", *_mesh(dp_shard=128, tp=1, pp=1))
    assert one_d.chosen is None and one_d.best_misfit is not None
    two_d = _plan(probe, 128, "batch.micro_size=2", "batch.global_size=32", *_mesh(dp_shard=16, tp=8, pp=1))
    assert two_d.chosen is not None and two_d.chosen.mesh.tp == 8
    # the tensor ranks divide the states 8-fold: far below the 1-D plan's peak even at twice the batch
    assert two_d.chosen.peak < 0.75 * one_d.best_misfit.peak


@pytest.mark.slow
def test_interleaved_1f1b_holds_less_than_1f1b(probe: ModelProbe) -> None:
    def busiest(schedule: str, micro: int) -> int:
        result = _plan(
            probe,
            512,
            f"batch.micro_size={micro}",
            "batch.global_size=256",
            *_mesh(dp_shard=8, tp=8, pp=8, pp_schedule=schedule),
        )
        assert result.chosen is not None
        (row,) = [r for r in result.ranked if r.scored.plan.sharding.describe() == "zero3"]
        return row.peak

    one_f_one_b, interleaved = busiest("1f1b", 4), busiest("interleaved_1f1b", 2)
    assert interleaved < 0.95 * one_f_one_b  # published 72.7 vs 82.5 GiB
