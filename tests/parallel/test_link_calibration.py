"""Calibration on a mesh (issue 25): each mesh dimension's link timed at the start of a run and cached
(planner/link_calibration.py, training/link_timing.py), a later plan for this machine ranked with it, and
the first steps' memory compared with the prediction on every rank.

One torchrun launch of 4 ranks (dp_shard 2 x tp 2) runs two jobs: the first (the planner choosing among one
checkpointing mode so the run has a prediction) writes the cache the other tests read; in the second, one
rank's first step passes the usable budget and every rank re-plans (`OverBudgetRank`)."""

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
from mesh_trainers import OverBudgetRank  # noqa: E402

MESH = {"dp_shard": 2, "tp": 2}
SECTIONS: dict[str, Any] = {
    "strategies": {"sharding": "zero3", "checkpointing": ["none"], "mesh": MESH},
    "batch": {"global_size": 8, "micro_size": 2},
    "train": {"steps": 3},
    "memory": {"track": True},
}
OVER_BUDGET: dict[str, Any] = {  # the same job, free to recompute, under a simulated budget
    **SECTIONS,
    "strategies": {**SECTIONS["strategies"], "checkpointing": ["none", "full"], "loss": "standard"},
    "memory": {"budget": 2**20},  # ~3x the busiest rank's predicted peak (~0.3 MB): every plan fits
    "planner": {"measure_links": False},  # the first job's links are cached
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
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """(the launch's directory, each job's results) of the two 4-rank jobs, with the cache on."""
    tmp = tmp_path_factory.mktemp("links")
    jobs = [
        {"run_dir": str(tmp / "job"), "sections": SECTIONS, "trainer": "RecordingTrainer"},
        {"run_dir": str(tmp / "over"), "sections": OVER_BUDGET, "trainer": "OverBudgetRank"},
    ]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEMTRAIN_CACHE_DIR", str(tmp / "cache"))
        return tmp, launch(tmp, 4, jobs, "links")


def _read(tmp: Path, job: str, name: str) -> dict[str, Any]:
    """A json file of job `job`'s run directory."""
    return dict(json.loads((Path(tiny_recipe_dict(tmp / job)["run"]["output_dir"]) / name).read_text()))


@pytest.fixture(scope="module")
def four_ranks(launched: tuple[Path, list[dict[str, Any]]]) -> tuple[Path, dict[str, Any]]:
    """(the cache directory, plan.json) of the first job: dp_shard 2 x tp 2 with the cache on."""
    tmp, _ = launched
    return tmp / "cache", _read(tmp, "job", "plan.json")


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


def _read_ids(ranks: list[dict[str, Any]], steps: int) -> list[list[int]]:
    """Per step, the ids the data-parallel ranks read together (tensor ranks of one agreeing), sorted."""
    read = []
    for step in range(steps):
        by_dp: dict[tuple[int, int], list[int]] = {}
        for rank in ranks:
            coordinates, ids = rank["coordinates"], rank["sample_ids"][str(step)]
            key = (coordinates["dp_replicate"], coordinates["dp_shard"])
            assert by_dp.setdefault(key, ids) == ids, (step, coordinates)  # a tensor rank read other rows
        read.append(sorted(i for ids in by_dp.values() for i in ids))
    return read


def test_a_rank_over_the_budget_in_a_run_replans_every_rank_at_the_same_step(
    launched: tuple[Path, list[dict[str, Any]]],
) -> None:
    """A real run of `test_a_rank_over_the_budget_replans_every_rank`: rank 3 alone measures step 1 over
    the usable budget; the calibration entry names its coordinates, every rank switches to the same plan
    after step 1 (the fastest that fits once the predictions carry rank 3's excess) and the run ends with
    all its steps, each step's samples read once, as the first job (no re-plan) read them."""
    tmp, (plain, over) = launched
    plan, summary = _read(tmp, "over", "plan.json"), _read(tmp, "over", "summary.json")
    usable = plan["budget"]["usable"]
    first = plan["calibration"][0]
    assert first["step"] == 1 and first["predicted"]["peak"] < usable
    three = MeshShape(**MESH).coordinates(OverBudgetRank.OVER)
    assert first["over_ranks"] == [three]
    peaks = [r["measured"]["peak"] for r in first["ranks"]]
    assert peaks[3] == int(usable * 1.01) and max(peaks[:3]) < usable
    (record,) = plan["replans"]
    assert record["step"] == 1 and record["reason"].startswith("measured peak ")
    assert " on rank 3 (dp_shard 1, tp 1) passed the usable " in record["reason"]
    assert record["from"]["checkpointing"] == "none" and record["to"] != record["from"]
    assert record["predicted_peak"] <= usable and record["correction"]["activation_ratio"] > 1
    for rank in over["ranks"]:  # every rank re-planned once, after step 1, to the same plan
        assert rank["replans"] == [{"step": 1, "to": record["to"]}] and rank["plan"] == record["to"]
    assert plan["summary"] == record["to"] and summary["plan"] == plan["plan"]
    later = plan["calibration"][1:]  # the new plan's first steps: compared again, on every rank, none over
    assert [e["step"] for e in later] == [2, 3] and all(e["over_ranks"] == [] for e in later)
    assert all(r["measured"]["peak"] < usable for e in later for r in e["ranks"])
    steps = SECTIONS["train"]["steps"]
    assert summary["steps"] == steps and len(over["losses"]) == steps
    read = _read_ids(over["ranks"], steps)
    assert read == _read_ids(plain["ranks"], steps)
    assert all(len(ids) == SECTIONS["batch"]["global_size"] for ids in read)
    assert len({i for ids in read for i in ids}) == steps * SECTIONS["batch"]["global_size"]
    assert over["losses"] == pytest.approx(plain["losses"], rel=1e-5)
