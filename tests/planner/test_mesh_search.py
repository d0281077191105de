"""The mesh search (issue 25): every factorisation of the ranks under the constraints, each plan divided by the
mesh, communication over the link each dimension crosses, ranked by tokens/s per GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.tensor_parallel import tensor_parallel_problems
from memtrain.cluster import DEFAULT_CLUSTER, Cluster, Link
from memtrain.errors import PlanError
from memtrain.memory.footprint import ModelShape, ParamInfo
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.mesh import MeshShape
from memtrain.planner.mesh_cost import Stage, activation_share, in_flight_blocks, stages
from memtrain.planner.mesh_explain import describe_meshes, meshes_to_json
from memtrain.planner.mesh_search import candidate_meshes, mesh_constraints, search_meshes, searches_meshes
from memtrain.planner.model_probe import ModelProbe

from helpers import probe_of
from planner_cases import MODEL, planner_recipe

OPEN = {"dp_shard": "auto", "tp": "auto", "pp": "auto"}


def _recipe(tmp_path: Path, **mesh: object) -> CausalLMRecipe:
    return planner_recipe(
        tmp_path,
        batch={"global_size": 16, "micro_size": 2},
        strategies={"checkpointing": "none", "sharding": "zero3", "mesh": mesh or OPEN},
    )


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> ModelProbe:
    torch.set_num_threads(1)
    return probe_of(_recipe(tmp_path_factory.mktemp("mesh")))


def _search(recipe: CausalLMRecipe, probe: ModelProbe, world: int, cluster: Cluster = DEFAULT_CLUSTER):
    config = type("C", (), dict(MODEL, tie_word_embeddings=False, base_model_tp_plan={"x": "colwise"}))()
    target = what_if_target(world, load_gpu("h100-80gb"), None, None)
    return search_meshes(
        recipe,
        lambda cp: probe,
        target,
        cluster,
        torch.device("cuda", 0),
        tensor_parallel_problems=lambda tp: tensor_parallel_problems(config, tp),
        pipeline=True,
    )


def test_every_factorisation_of_the_open_degrees(tmp_path: Path) -> None:
    meshes = list(candidate_meshes(_recipe(tmp_path), 8))
    assert {(m.dp_shard, m.tp, m.pp) for m in meshes} == {
        (d, t, p) for d in (1, 2, 4, 8) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if d * t * p == 8
    }
    pinned = list(candidate_meshes(_recipe(tmp_path, dp_shard="auto", tp=2), 8))
    assert [(m.dp_shard, m.tp) for m in pinned] == [(4, 2)]
    assert searches_meshes(_recipe(tmp_path), what_if=False)  # tp and pp open
    assert searches_meshes(_recipe(tmp_path, dp_shard="auto", tp=2), what_if=True)
    assert not searches_meshes(
        _recipe(tmp_path, dp_shard="auto", tp=2), what_if=False
    )  # the run's rank trace
    assert not searches_meshes(planner_recipe(tmp_path), what_if=True)


def test_constraints_name_what_rules_a_mesh_out(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)

    def problems(
        mesh: MeshShape,
        tp_problems: Any = None,
        cluster: Cluster = DEFAULT_CLUSTER,
        pipeline: bool = True,
        blocks: int = 5,
    ) -> str:
        found = mesh_constraints(
            mesh,
            recipe,
            cluster=cluster,
            num_blocks=blocks,
            seq_len=32,
            tensor_parallel_problems=tp_problems,
            pipeline=pipeline,
        )
        return "\n".join(found)

    small_nodes = dataclasses.replace(DEFAULT_CLUSTER, gpus_per_node=2)
    heads = problems(
        MeshShape(tp=4, dp_shard=2), lambda tp: [f"tp {tp} does not divide the heads"], small_nodes
    )
    assert "within a node of 2 GPUs" in heads and "does not divide the heads" in heads
    assert "does not divide the model's 5 blocks" in problems(MeshShape(pp=2, dp_shard=4))
    assert "cannot split its model into pipeline stages" in problems(
        MeshShape(pp=2, dp_shard=4), pipeline=False
    )
    assert "has 0 blocks, fewer than the stages" in problems(MeshShape(pp=2, dp_shard=4), blocks=0)
    assert problems(MeshShape(dp_shard=8), blocks=0) == "", "no pipeline: a model without blocks is fine"
    assert "batch.global_size" in problems(MeshShape(dp_shard=32))
    assert "no tensor_parallel_plan" in problems(MeshShape(tp=2, dp_shard=4))
    assert problems(MeshShape(dp_shard=8)) == ""


def test_tensor_ranks_divide_matrices_and_keep_vectors_whole(probe: ModelProbe) -> None:
    shape = probe.shape
    (whole,) = stages(shape, MeshShape(dp_shard=8))
    (split,) = stages(shape, MeshShape(dp_shard=4, tp=2))
    matrices = sum(p.numel for p in shape.params if len(p.dims) >= 2)
    vectors = shape.numel - matrices
    assert whole.numel == shape.numel
    assert split.numel == pytest.approx(matrices / 2 + vectors)
    first, last = stages(shape, MeshShape(pp=5, dp_shard=1))
    embedding = sum(p.numel for p in shape.params if "embed" in p.name)
    assert first.first and not last.first and first.blocks == last.blocks == 1
    per_block = sum(p.numel for p in shape.params if p.block is not None) / 5
    head_and_norm = sum(p.numel for p in shape.params if p.block is None) - embedding
    assert (first.numel, last.numel) == pytest.approx((per_block + embedding, per_block + head_and_norm))


def test_schedules_hold_micro_batches_in_flight_as_torch_runs_them() -> None:
    (first, last) = stages_of(MeshShape(pp=4, pp_schedule="1f1b"))
    assert in_flight_blocks(MeshShape(pp=4, pp_schedule="1f1b"), 8, first, 16) == 4 * 4  # p micro-batches
    assert in_flight_blocks(MeshShape(pp=4, pp_schedule="1f1b"), 8, last, 16) == 4  # one
    assert in_flight_blocks(MeshShape(pp=4, pp_schedule="gpipe"), 8, first, 16) == 8 * 4  # all of them
    # interleaved, v = 2: (v-1)p + 2(p-1) + 1 = 11 chunks of 16 / 8 blocks on the first rank
    assert in_flight_blocks(MeshShape(pp=4, pp_schedule="interleaved_1f1b"), 8, first, 16) == 22
    assert in_flight_blocks(MeshShape(pp=4, pp_schedule="1f1b"), 2, first, 16) == 2 * 4  # m < p
    assert activation_share(MeshShape(tp=4)) == pytest.approx(1 / 4)
    assert activation_share(MeshShape(tp=4, sequence_parallel=False)) == pytest.approx(16 / 34)


def stages_of(mesh: MeshShape) -> list[Stage]:
    """The stages of 16 blocks of one 10 x 10 matrix each after a 5 x 10 embedding."""
    params = tuple(ParamInfo(f"layers.{i}.w", 100, i, dims=(10, 10)) for i in range(16))
    return stages(ModelShape((ParamInfo("embed_tokens.weight", 50, None, dims=(5, 10)), *params), 16), mesh)


def test_a_ring_moves_k_minus_one_kth_over_its_link() -> None:
    link = Link(bandwidth=1e9, latency=1e-5)
    assert link.ring_seconds(4e9, 4) == pytest.approx(3.0 + 3 * 1e-5)
    assert link.ring_seconds(4e9, 1) == 0.0
    mesh = MeshShape(dp_shard=4, tp=4)
    assert mesh.crossing(8) == ["dp_shard"]
    assert DEFAULT_CLUSTER.link(mesh, ("tp",)) == DEFAULT_CLUSTER.within
    assert DEFAULT_CLUSTER.link(mesh, ("dp_shard",)) == DEFAULT_CLUSTER.between


def test_the_search_ranks_meshes_by_tokens_per_second(tmp_path: Path, probe: ModelProbe) -> None:
    result = _search(_recipe(tmp_path), probe, 16)
    assert result.chosen is not None
    speeds = [r.tokens_per_second for r in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.mesh.tp <= 8 for r in result.ranked)  # within a node of 8
    assert any("does not divide the model's 5 blocks" in why for _, why in result.excluded)
    # tensor ranks divide a plan's states: the same plan on dp 2 x tp 8 holds less than on dp 16 / ... of its states
    chosen = result.chosen
    document = meshes_to_json(result)
    assert document["chosen"]["mesh"] == chosen.mesh.to_dict()
    assert set(document["sources"]) == {"model states", "activations", "communication"}
    assert all("crosses_nodes" in m and "exposed_communication_seconds" in m for m in document["meshes"])
    assert "chosen: mesh" in describe_meshes(result, "title")
    # on a CUDA target the rows are held to reserved bytes: the allocator's overhead over the replayed step
    assert chosen.reserved is not None and chosen.reserved >= chosen.peak
    assert chosen.required <= result.target.budget.usable
    assert document["chosen"]["predicted_reserved"] == chosen.reserved


def test_a_slow_network_moves_tensor_parallelism_inside_the_node(tmp_path: Path, probe: ModelProbe) -> None:
    """Two nodes of 8: tensor parallelism 16 would cross nodes (not allowed for an open degree); across a node
    boundary, the dimension named as crossing is the data-parallel one."""
    recipe = _recipe(tmp_path, dp_shard="auto", tp="auto")
    result = _search(recipe, probe, 16)
    for row in result.ranked:
        assert row.mesh.tp <= 8
        crossing = row.mesh.crossing(8)
        assert "tp" not in crossing
    slow = dataclasses.replace(DEFAULT_CLUSTER, between=Link(bandwidth=1e6, latency=1e-3))
    fast = dataclasses.replace(DEFAULT_CLUSTER, between=DEFAULT_CLUSTER.within)
    by_mesh = lambda res: {r.mesh.degrees: r.cost.exposed.get("dp_shard", 0.0) for r in res.ranked}  # noqa: E731
    slow_exposed, fast_exposed = (
        by_mesh(_search(recipe, probe, 16, slow)),
        by_mesh(_search(recipe, probe, 16, fast)),
    )
    crossing_mesh = next(d for d in slow_exposed if MeshShape(*d).crossing(8) == ["dp_shard"])
    assert slow_exposed[crossing_mesh] > 100 * fast_exposed[crossing_mesh]


def test_no_mesh_names_every_reason(tmp_path: Path, probe: ModelProbe) -> None:
    recipe = _recipe(tmp_path, dp_shard=32)
    with pytest.raises(PlanError, match="batch.global_size"):
        _search(recipe, probe, 32)
