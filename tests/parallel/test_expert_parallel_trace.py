"""The planner's rank trace of an expert-parallel mesh (EP 2 x FSDP 2, 4 ranks) against each rank's tracker in
a real gloo run, for a balanced router and a skewed one (every router biased towards expert 0:
`moe_trainers.SkewedMoETrainer`). Acceptance (issue 40): each ep rank's predicted peak within -0.5% / +3% of
the measured one, with the rows each rank received set from the run's routing (`routing={"calls": ...}`:
the counts of every dispatch of the measured step, replayed in order, `strategies.expert_parallel.measured`);
and with an imbalance factor (`{"imbalance": f}`), the prediction moves with it and does not fall under the
busiest rank when the factor covers what the run's busiest dispatch received.

What gloo holds that the fake group does not: the input of the all-to-all that sends the experts' outputs
back, alive through the unpermuting and weighting after it in some runs and not in others (+3.4% of a 2-layer
model's peak, 5.6 KB, where it was missing): the trace holds it (`memory.gloo_buffers`), so it predicts the
higher of the two timings, here up to +1.9% over the lower (4 layers).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.distributed import DistEnv
from memtrain.plan import mesh_of, pinned_plan
from memtrain.planner.rank_trace import trace_routings

from helpers import tiny_recipe_dict

sys.path.insert(0, str(Path(__file__).parent))
import moe_trainers  # noqa: E402
from mesh_jobs import launch  # noqa: E402

UNDER, OVER = -0.005, 0.03
CASES = {"balanced": "MoETrainer", "skewed": "SkewedMoETrainer"}
TOKENS_K = 16 * moe_trainers.TOP_K  # a micro-batch's (token, expert) pairs: 1 row of 16 tokens, top-2


def _sections() -> dict[str, Any]:
    return {
        "strategies": {
            "sharding": "zero3",
            "precision": "fp32",
            "checkpointing": "none",
            "mesh": {"dp_shard": 4, "ep": 2},
        },
        "batch": {"global_size": 8, "micro_size": 1},
        "train": {"steps": 2},
        "memory": {"track": True},
    }


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Case -> each rank's measured and predicted peak, the busiest rank, its predictions at the imbalance
    factors 1 and `covering` (its busiest dispatch's rows over the mean), and the run's last metrics row."""
    tmp = tmp_path_factory.mktemp("ep_trace")
    jobs = [
        {
            "run_dir": str(tmp / case),
            "sections": _sections(),
            "trainer": name,
            "trainer_module": "moe_trainers",
        }
        for case, name in CASES.items()
    ]
    runs = launch(tmp, 4, jobs, name="ep_trace")
    out = {}
    for (case, name), run in zip(CASES.items(), runs, strict=True):
        cls = getattr(moe_trainers, name)
        raw = tiny_recipe_dict(tmp / case, **_sections())
        recipe = cls.recipe_class.from_dict({k: v for k, v in raw.items() if k not in ("model", "data")})
        mesh = mesh_of(recipe, 4)
        plan = pinned_plan(recipe, DistEnv(0, 4, 0, torch.device("cpu"), mesh=mesh)).replace(mesh=mesh)
        spec = cls(recipe).model_spec()

        measured = [sum(rank["tracked"].values()) for rank in run["ranks"]]
        busiest = max(range(4), key=measured.__getitem__)
        calls = run["ranks"][busiest]["routing_calls"]
        covering = max(sum(map(sum, call["received"])) for call in calls) / TOKENS_K
        # each rank's traces in one process: its measured routing, and the busiest rank's two factors too
        peaks = []
        for r, rank in enumerate(run["ranks"]):
            routings = [{"calls": rank["routing_calls"]}]
            routings += [{"imbalance": 1.0}, {"imbalance": covering}] if r == busiest else []
            traces = trace_routings(spec, plan, r, routings)
            peaks.append([trace.prediction(spec.host_bytes()).peak for trace in traces])
        out[case] = {
            "measured": measured,
            "predicted": [found[0] for found in peaks],
            "busiest": busiest,
            "covering": covering,
            "at_one": peaks[busiest][1],
            "at_covering": peaks[busiest][2],
            "row": run["rows"][-1],
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_rank_trace_predicts_each_ep_ranks_peak(case: str, traced: dict[str, dict[str, Any]]) -> None:
    """Every rank of EP 2 x FSDP 2, balanced and skewed: within -0.5% / +3% of its tracked peak, the rows its
    experts received set from the run's routing. The hole: the trace had never run an MoE model per rank
    (its routing was whatever fake values route, and under the fake process group the exchanged counts are
    garbage), and ep > 1 was refused."""
    found = traced[case]
    for rank, (predicted, measured) in enumerate(zip(found["predicted"], found["measured"], strict=True)):
        error = (predicted - measured) / measured
        assert UNDER <= error <= OVER, (case, rank, predicted, measured, f"{error:+.2%}")


@pytest.mark.slow
def test_the_prediction_moves_with_the_imbalance(traced: dict[str, dict[str, Any]]) -> None:
    """The skewed router loads its busiest expert more (metrics: each layer's max over mean), and its busiest
    rank holds more than a balanced bound (factor 1) predicts; with a factor covering its busiest dispatch
    the prediction is not under it, for either router, and a higher factor predicts more."""
    balanced, skewed = traced["balanced"], traced["skewed"]
    assert min(skewed["row"]["ep_load_max_over_mean"]) > max(balanced["row"]["ep_load_max_over_mean"])
    assert skewed["covering"] > balanced["covering"] >= 1.0
    assert skewed["at_one"] < skewed["measured"][skewed["busiest"]]  # a balanced bound under-predicts
    for found in (balanced, skewed):
        measured = found["measured"][found["busiest"]]
        assert found["at_covering"] >= measured * (1 + UNDER), found
        assert found["at_covering"] > found["at_one"]
    assert skewed["at_covering"] > balanced["at_covering"]
