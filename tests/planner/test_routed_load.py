"""Expert parallelism in the planner (issue 40): the busiest ep rank's routed load as an explicit quantity
(`strategies.moe.max_load`, a capacity factor), its memory and time on a mesh, the mesh search over ep.

Expected values are arithmetic from the model config (experts, top-k, hidden and expert sizes) and the
recipe, never numbers read off the planner; the mesh cost at ep = 1 must be the traced one-device MoE
prediction itself (the data-parallel trace is the ep = 1 program)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.cluster import DEFAULT_CLUSTER
from memtrain.errors import PlanError, RecipeError
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.planner.expert_parallel import ExpertRouting, ep_degrees, routed_load
from memtrain.planner.mesh_explain import describe_meshes, meshes_to_json
from memtrain.planner.mesh_search import MeshResult, MeshScored, search_meshes, searches_meshes
from memtrain.planner.model_probe import ModelProbe

from helpers import probe_of
from planner_cases import planner_recipe

TINY_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
SEQ = 32
QWEN3_30B = ExpertRouting(experts=128, top_k=8, hidden=2048, intermediate=768)  # its config.json


def _recipe(tmp_path: Path, *, moe: dict[str, Any] | None = None, **mesh: object) -> CausalLMRecipe:
    return planner_recipe(
        tmp_path,
        model={"config": TINY_MOE},
        data={"seq_len": SEQ},
        batch={"global_size": 16, "micro_size": 2},
        strategies={
            "precision": "bf16-mixed",
            "checkpointing": "none",
            "sharding": "zero3",
            "optimizer_states": "fp32",
            "mesh": mesh or {"dp_shard": "auto", "ep": "auto"},
            "moe": moe or {},
        },
    )


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> ModelProbe:
    torch.set_num_threads(1)
    return probe_of(_recipe(tmp_path_factory.mktemp("moe")))


def _search(recipe: CausalLMRecipe, probe: ModelProbe, world: int = 8, what_if: bool = True) -> MeshResult:
    target = dataclasses.replace(what_if_target(world, load_gpu("h100-80gb"), None, None), what_if=what_if)
    return search_meshes(
        recipe,
        lambda cp: probe,
        target,
        DEFAULT_CLUSTER,
        torch.device("cuda", 0),
        tensor_parallel_problems=None,
        pipeline=False,
    )


def _rows(result: MeshResult) -> dict[int, MeshScored]:
    """The fastest row of each ep degree, fit or not (the tiny model fits everywhere)."""
    found: dict[int, MeshScored] = {}
    for row in result.ranked:
        found.setdefault(row.mesh.ep, row)
    return found


def test_the_busiest_rank_routes_its_bound_times_the_mean_capped_by_what_can_reach_it() -> None:
    tokens = 4096
    mean = tokens * QWEN3_30B.top_k  # every rank sends T k rows; the mean rank receives as many
    assert (
        routed_load(QWEN3_30B, tokens, 1, 3.0, None).rows == mean
    )  # one rank: its own rows, whatever the bound
    assert routed_load(QWEN3_30B, tokens, 4, 1.5, None).rows == math.ceil(mean * 1.5)
    assert routed_load(QWEN3_30B, tokens, 4, 1.5, None).load == pytest.approx(1.5, rel=1e-6)
    # no bound routes more than every token's rows to one rank: 4 ranks x T x min(k, 128 / 4 experts there)
    assert routed_load(QWEN3_30B, tokens, 4, 100.0, None).rows == 4 * tokens * 8
    # 64 ranks of 2 experts each: a token sends at most 2 of its 8 rows to one rank
    assert routed_load(QWEN3_30B, tokens, 64, 100.0, None).rows == 64 * tokens * 2


def test_a_capacity_factor_pads_every_expert_to_capacity_whatever_the_bound() -> None:
    """Tokens over capacity are dropped and buffers padded: C = ceil(cf T k / E) rows per expert from each
    source rank, so a rank runs ep x (E / ep) x C rows."""
    tokens, cf = 1000, 1.25
    capacity = math.ceil(cf * tokens * 8 / 128)
    for ep in (1, 4, 16):
        for bound in (1.0, 2.0, 8.0):
            load = routed_load(QWEN3_30B, tokens, ep, bound, cf)
            assert load.rows == ep * (128 // ep) * capacity


def test_ep_degrees_divide_the_experts_and_the_shard_group() -> None:
    assert ep_degrees(8, 8) == [1, 2, 4, 8]
    assert ep_degrees(8, 12) == [1, 2, 4]
    assert ep_degrees(60, 8) == [1, 2, 4]


def test_the_bound_and_capacity_keys_are_checked_by_name(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"strategies\.moe\.max_load"):
        _recipe(tmp_path, moe={"max_load": 0.5})
    with pytest.raises(RecipeError, match=r"strategies\.moe\.capacity_factor"):
        _recipe(tmp_path, moe={"capacity_factor": 0})
    assert _recipe(tmp_path).strategies.moe.max_load >= 1.0  # a stated default bound
    assert searches_meshes(_recipe(tmp_path), what_if=False)  # ep auto is a dimension of the search


@pytest.mark.slow
def test_ep_one_is_the_traced_one_device_prediction(tmp_path: Path, probe: ModelProbe) -> None:
    """At ep = 1 (dropless) every rank runs its own T k rows, as the trace did: the mesh cost's memory is the
    data-parallel plan's traced prediction to the byte, whatever the bound."""
    for bound in (1.0, 4.0):
        result = _search(_recipe(tmp_path, moe={"max_load": bound}, dp_shard="auto", ep=1), probe)
        for row in result.ranked:
            assert row.mesh.ep == 1
            moments = row.scored.prediction.moments or (row.scored.prediction.at_peak,)
            assert row.cost.footprint == max(moments, key=lambda f: f.peak)
            assert row.cost.experts is not None and row.cost.experts.extra_bytes == 0


@pytest.mark.slow
def test_the_busiest_rank_holds_its_routed_rows_and_more_with_the_bound(
    tmp_path: Path, probe: ModelProbe
) -> None:
    """Per kept MoE layer a routed row keeps its input, gate/up output and activation: (h + 3 I) x 2 bytes in
    bf16; the busiest of ep ranks keeps (bound - 1) T k rows more than the trace, plus one layer's send and
    receive buffers (T k + R) h x 2. Memory grows with the bound, and each 0.5 costs the arithmetic's bytes."""
    h, inter, k, layers = TINY_MOE["hidden_size"], TINY_MOE["moe_intermediate_size"], 2, 4

    def expected(tokens: int, bound: float) -> int:
        busiest = math.ceil(tokens * k * bound)
        return layers * (busiest - tokens * k) * (h + 3 * inter) * 2 + (tokens * k + busiest) * h * 2

    peaks = []
    for bound in (1.0, 1.5, 2.0, 3.0):
        rows = _rows(_search(_recipe(tmp_path, moe={"max_load": bound}), probe))
        assert set(rows) == {1, 2, 4, 8}
        row = rows[4]
        experts = row.cost.experts
        assert experts is not None
        tokens = row.scored.plan.micro_batch_size * SEQ
        assert experts.load.rows == math.ceil(tokens * k * bound)
        assert experts.extra_bytes == expected(tokens, bound)
        assert experts.per_half_load == expected(tokens, bound + 0.5) - expected(tokens, bound) > 0
        peaks.append(row.peak)
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


@pytest.mark.slow
def test_ep_gathers_fewer_experts_and_pays_all_to_alls(tmp_path: Path, probe: ModelProbe) -> None:
    """FSDP gathers E / ep experts of a layer: at a bound of 1 the weights a rank holds at its peak shrink
    with ep; the all-to-alls are an `ep` entry in the exposed communication, absent at ep = 1."""
    rows = _rows(_search(_recipe(tmp_path, moe={"max_load": 1.0}), probe))
    same_plan = {ep: row for ep, row in rows.items() if row.scored.plan == rows[1].scored.plan}
    assert len(same_plan) > 1
    weights = [same_plan[ep].cost.footprint.weights for ep in sorted(same_plan)]
    assert weights == sorted(weights, reverse=True) and weights[0] > weights[-1]
    assert "ep" not in rows[1].cost.exposed
    assert all(rows[ep].cost.exposed.get("ep", 0) > 0 for ep in rows if ep > 1)


@pytest.mark.slow
def test_a_pinned_ep_that_cannot_split_the_experts_is_ruled_out_by_name(
    tmp_path: Path, probe: ModelProbe
) -> None:
    with pytest.raises(PlanError, match=r"dp 2: strategies\.mesh\.ep: 4 must divide the shard group"):
        _search(_recipe(tmp_path, dp_shard="auto", ep=4), probe, world=2)
    with pytest.raises(PlanError, match=r"strategies\.mesh\.ep: 3 must divide .* the 8 experts"):
        _search(_recipe(tmp_path, dp_shard="auto", ep=3), probe, world=6)


@pytest.mark.slow
def test_a_dense_model_keeps_ep_one(tmp_path: Path) -> None:
    pinned = {"precision": "bf16-mixed", "checkpointing": "none", "optimizer_states": "fp32"}
    mesh = {"dp_shard": "auto", "ep": "auto"}
    recipe = planner_recipe(tmp_path, strategies={**pinned, "sharding": "zero3", "mesh": mesh})
    dense = probe_of(recipe)
    result = _search(recipe, dense, world=4)
    assert {row.mesh.ep for row in result.ranked} == {1}
    assert all(row.cost.experts is None for row in result.ranked)


def test_replace_keeps_the_mesh_valid() -> None:
    """The search sets ep on a mesh it resolved with ep 1 (ep must divide dp_shard)."""
    from memtrain.mesh import MeshShape

    mesh = MeshShape(dp_shard=8)
    assert dataclasses.replace(mesh, ep=4).expert_shards == 2
    with pytest.raises(ValueError, match="strategies.mesh.ep"):
        dataclasses.replace(mesh, ep=3)


@pytest.mark.slow
def test_plan_shows_the_bound_and_what_half_more_costs(tmp_path: Path, probe: ModelProbe) -> None:
    """The human table says the bound assumed and each 0.5 more's cost per rank; --json carries both."""
    result = _search(_recipe(tmp_path, moe={"max_load": 2.0}, dp_shard="auto", ep=4), probe)
    chosen = result.chosen
    assert chosen is not None and chosen.cost.experts is not None
    text = describe_meshes(result, "title")
    line = next(x for x in text.splitlines() if x.startswith("  routed load:"))
    assert "the busiest of 4 ep ranks at 2.00 x the mean (strategies.moe.max_load 2)" in line
    assert f"{chosen.cost.experts.per_half_load / 2**30:.2f} GiB per rank" in line
    document = meshes_to_json(result)
    experts = document["chosen"]["experts"]
    assert experts["max_load"] == 2.0 and experts["capacity_factor"] is None
    assert experts["bytes_per_half_load"] == chosen.cost.experts.per_half_load > 0
    assert experts["routed_rows_busiest"] == 2 * experts["routed_rows_mean"]
    assert "expert parallelism" in document["sources"]
    capped = _search(_recipe(tmp_path, moe={"capacity_factor": 1.0}, dp_shard="auto", ep=4), probe)
    assert "padded to capacity" in describe_meshes(capped, "title")
    assert meshes_to_json(capped)["chosen"]["experts"]["bytes_per_half_load"] == 0  # capped: no more rows


@pytest.mark.slow
def test_a_runs_open_ep_keeps_to_what_this_version_runs(tmp_path: Path, probe: ModelProbe) -> None:
    """Expert parallelism runs under FSDP2, so a run's open ep scores every ep; beside context parallelism
    (not run with ep by this version) a what-if scores every ep, noted, a run's open ep does not choose a mesh
    it would then refuse, and a pinned one is planned and noted."""
    assert {row.mesh.ep for row in _search(_recipe(tmp_path), probe, what_if=False).ranked} == {1, 2, 4, 8}
    with_cp = _recipe(tmp_path, dp_shard="auto", cp=2, ep="auto")
    assert {row.mesh.ep for row in _search(with_cp, probe).ranked} == {1, 2, 4}
    assert {row.mesh.ep for row in _search(with_cp, probe, what_if=False).ranked} == {1}
    pinned = _search(_recipe(tmp_path, dp_shard="auto", cp=2, ep=2), probe, what_if=False)
    assert {row.mesh.ep for row in pinned.ranked} == {2}
    assert any(note.startswith("strategies.mesh.ep: 2") for note in pinned.notes)
