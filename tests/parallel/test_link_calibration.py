"""Calibration on a mesh (issue 25): each mesh dimension's link timed at the start of a run and cached
(planner/link_calibration.py, training/link_timing.py), a later plan for this machine ranked with it, and
the first steps' memory compared with the prediction on every rank.

One torchrun launch of 4 ranks (dp_shard 2 x tp 2, the planner choosing among one checkpointing mode so the
run has a prediction) writes the cache the other tests read."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cluster import DEFAULT_CLUSTER, Link
from memtrain.distributed import DistEnv
from memtrain.memory.headroom import MemoryBudget
from memtrain.mesh import MeshShape
from memtrain.planner import PlanResult, here_target, plan_meshes
from memtrain.planner import link_calibration as links
from memtrain.planner.link_calibration import MeasuredLink, Timing, fit_link
from memtrain.planner.mesh_search import MeshResult
from memtrain.training import memory_monitor
from memtrain.training.link_timing import measure_links
from memtrain.training.memory_monitor import MemoryMonitor

from helpers import tiny_recipe_dict

sys.path.insert(0, str(Path(__file__).parent))
from mesh_jobs import launch  # noqa: E402

MESH = {"dp_shard": 2, "tp": 2}
SECTIONS: dict[str, Any] = {
    "strategies": {"sharding": "zero3", "checkpointing": ["none"], "mesh": MESH},
    "batch": {"global_size": 8, "micro_size": 2},
    "train": {"steps": 2},
    "memory": {"track": True},
}


def test_a_link_is_fitted_from_timings_of_two_sizes() -> None:
    """Seconds that a known link's rings take, over groups of 2 and 4 ranks, give that link back; noise
    that leaves the latency negative falls back on the small size's seconds per ring step."""
    known = Link(bandwidth=2.5e9, latency=40e-6)
    timings = [
        Timing(kind, ranks, size, known.ring_seconds(size * steps, ranks, steps))
        for kind, steps in links.RING_STEPS.items()
        for ranks in (2, 4)
        for size in (256, 2**20)
    ]
    fitted = fit_link(timings)
    assert fitted.bandwidth == pytest.approx(known.bandwidth, rel=1e-9)
    assert fitted.latency == pytest.approx(known.latency, rel=1e-9)
    noisy = [Timing("all_gather", 2, 256, 1e-6), Timing("all_gather", 2, 2**20, 1e-2)]
    assert fit_link(noisy).latency == pytest.approx(1e-6)  # the fit's own latency came out negative
    with pytest.raises(ValueError, match="two sizes"):
        fit_link(noisy[:1])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """(the cache directory, plan.json) of a 4-rank run on dp_shard 2 x tp 2 with the cache on."""
    tmp = tmp_path_factory.mktemp("links")
    cache = tmp / "cache"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEMTRAIN_CACHE_DIR", str(cache))
        launch(tmp, 4, [{"run_dir": str(tmp / "job"), "sections": SECTIONS}], "links")
    raw = tiny_recipe_dict(tmp / "job", **SECTIONS)
    return cache, json.loads((Path(raw["run"]["output_dir"]) / "plan.json").read_text())


def test_a_run_on_a_mesh_caches_each_dimensions_link(four_ranks: tuple[Path, dict[str, Any]]) -> None:
    """Under the key a plan of 4 ranks on a node of 8 reads: the same 4 ranks on one node."""
    cache, plan = four_ranks
    entries = json.loads((cache / links.CACHE_FILE).read_text())
    key = links.layout_key(torch.device("cpu"), DEFAULT_CLUSTER, 4)
    assert list(entries) == [key]
    cached = entries[key]["links"]
    assert [m["dim"] for m in cached] == ["dp_shard", "tp"]
    assert all(m["bandwidth"] > 0 and m["latency"] > 0 and not m["crosses_nodes"] for m in cached)
    assert plan["links"]["links"] == cached and plan["links"]["seconds"] < 5


def test_every_rank_is_calibrated_against_the_prediction(four_ranks: tuple[Path, dict[str, Any]]) -> None:
    """Each rank's measured peak and components beside the busiest rank's predicted ones; none over."""
    _, plan = four_ranks
    first = plan["calibration"][0]
    assert first["predicted"]["peak"] > 0 and first["predicted_where"].startswith("rank 0")
    ranks = first["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["coordinates"] for r in ranks] == [MeshShape(**MESH).coordinates(r) for r in range(4)]
    for rank in ranks:
        assert rank["measured"]["peak"] > 0 and set(rank["relative_error"]) >= {"peak", "weights"}
    assert first["over_ranks"] == [] and not any(r["over"] for r in ranks)


def test_a_plan_for_this_machine_ranks_with_the_measured_links(
    four_ranks: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mesh search for 4 ranks here reads the cache (and says so): tensor parallelism's exposed seconds
    grow as the measured gloo link is slower than the assumed NVLink."""
    cache, _ = four_ranks
    recipe = CausalLMRecipe.from_dict(tiny_recipe_dict(tmp_path, **SECTIONS))
    spec = CausalLMTrainer(recipe).model_spec()
    target = replace(here_target(recipe, 4), mesh=None)  # as `memtrain plan` searches
    assumed_cluster = DEFAULT_CLUSTER  # 8 GPUs per node (`memtrain plan` without --gpus-per-node)

    def plan(progress: Any = lambda _line: None) -> MeshResult:
        return plan_meshes(recipe, spec, target, assumed_cluster, spec_at=lambda _s: spec, progress=progress)

    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(cache))
    said: list[str] = []
    here = plan(said.append)
    assert any(line.startswith("links measured here: dp_shard (within a node)") for line in said)
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path / "empty"))
    assumed = plan()
    first = json.loads((cache / links.CACHE_FILE).read_text()).popitem()[1]["links"][0]  # dp_shard, 2 ranks
    assert here.cluster.within == Link(first["bandwidth"], first["latency"])
    assert here.cluster.between == assumed.cluster.between and assumed.cluster == assumed_cluster
    assert here.chosen is not None and assumed.chosen is not None
    assert here.chosen.cost.exposed["tp"] > 10 * assumed.chosen.cost.exposed["tp"]


def test_a_damaged_cache_is_ignored_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    key = links.layout_key(torch.device("cpu"), DEFAULT_CLUSTER, 4)
    (tmp_path / links.CACHE_FILE).write_text("{not json")
    assert links.load(key) is None
    assert "link calibration: ignoring the link cache" in capsys.readouterr().err
    negative = {key: {"version": links.VERSION, "links": [{"dim": "tp", "ranks": 2, "crosses_nodes": False,
                                                          "bandwidth": -1.0, "latency": 1e-5}]}}  # fmt: skip
    (tmp_path / links.CACHE_FILE).write_text(json.dumps(negative))
    assert links.load(key) is None
    assert "not a positive number" in capsys.readouterr().err
    good = MeasuredLink("tp", 2, False, Link(1e9, 1e-4))
    assert links.store(key, [good]) is not None  # the damaged entry is replaced
    assert links.load(key) == [good]


def test_nothing_is_measured_when_the_cache_is_off_or_the_recipe_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four ranks without a process group: any collective would raise, so returning means none ran."""
    env = DistEnv(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), mesh=MeshShape(**MESH))
    assert measure_links(env, enabled=True) == (env, None)  # MEMTRAIN_CACHE_DIR=off (tests/conftest.py)
    monkeypatch.setenv("MEMTRAIN_CACHE_DIR", str(tmp_path))
    assert measure_links(env, enabled=False) == (env, None)
    assert not (tmp_path / links.CACHE_FILE).exists()


def test_a_rank_over_the_budget_replans_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 within the budget learns from the gathered figures that rank 3 passed it: the calibration
    entry names rank 3's coordinates and rank 0 re-plans too, with a reason naming rank 3."""
    env = DistEnv(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), mesh=MeshShape(**MESH))
    written: list[dict[str, Any]] = []
    monitor = MemoryMonitor(env, SimpleNamespace(write_plan=written.append))  # type: ignore[arg-type]
    budget = MemoryBudget(total=2000, free=2000, reserve=0, usable=1000, source="test")
    monitor.plan_result = PlanResult(plan=SimpleNamespace(), budget=budget)  # type: ignore[arg-type]
    plan = SimpleNamespace(to_dict=dict, summary=str)

    def gathered(mine: dict[str, Any], _env: DistEnv) -> list[dict[str, Any]]:
        over = {**mine, "rank": 3, "coordinates": env.shape.coordinates(3), "measured": {"peak": 1500}}
        return [mine, {**mine, "rank": 1}, {**mine, "rank": 2}, {**over, "over": True}]

    monkeypatch.setattr(memory_monitor, "gather_objects", gathered)
    monitor.start_at(0)
    why = monitor.after_step(0, {"peak_memory_bytes": 0}, plan, last=False)  # type: ignore[arg-type]
    assert why is not None and why.reason.startswith("measured peak 1.46 KiB on rank 3 (dp_shard 1, tp 1)")
    entry = written[-1]["calibration"][-1]
    assert entry["over_ranks"] == [env.shape.coordinates(3)]
    assert [r["over"] for r in entry["ranks"]] == [False, False, False, True]
