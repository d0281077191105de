"""`python -m memtrain.commands.rank_trace REQUEST.json RESULT.json`: the planner's rank traces of a mesh, in a
process of their own.

Why a process: torch's fake process group is process-global, and the process that plans may already be a
rank of a real group (a run's `choose_plan`, or a re-plan). The planner (`memtrain.planner.rank_trace`) writes
a request and starts this module; it builds the same trainer (`trainer`: its class as `--trainer` names one,
`recipe`: the recipe as a dict), joins the fake group as the requested rank, and runs each plan's step
there (`memtrain.training.rank_trace.trace_step`). Everything crosses as JSON: the request's plans through
`Plan.from_dict`, the recipe through its class's validation; nothing is unpickled.

Request: `{"trainer": str, "recipe": {...}, "world_size": N, "rank": r, "traces": [{"plan": {...}, "rows":
int | null, "routing": {...} | null}, ...]}` (`routing`: under expert parallelism, how many rows this rank's
experts receive: `{"imbalance": factor}` or a run's `{"calls": ...}`, `strategies.expert_parallel.rule_from`;
absent on an ep mesh: a balanced router, `{"imbalance": 1.0}`, as the fake group's exchanged counts are garbage) (one rank per process: torch keeps references to a group a process has left). Result: `{"traces": [...]}`, one per request in order, each the tracker's report
(`peak`, `at_peak`, `maxima`, `where`) or `{"error": "..."}` (a trace that cannot run: the planner predicts
that plan by formula and says why).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from memtrain.commands.trainers import for_recipe, trainer_class
from memtrain.errors import MemtrainError
from memtrain.memory import join_fake_process_group
from memtrain.plan import Plan
from memtrain.strategies.expert_parallel import counts_from, rule_from
from memtrain.training.rank_trace import trace_step
from memtrain.training.trainer import Trainer


def run(request: dict[str, Any]) -> list[dict[str, Any]]:
    """Every trace of `request`, in order (see the module docstring)."""
    world, rank = int(request["world_size"]), int(request["rank"])
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK="0")  # what `init_distributed` reads
    join_fake_process_group(rank, world)
    cls = trainer_class(str(request["trainer"]))
    recipe = cls.recipe_class.from_dict(request["recipe"])
    trainer = for_recipe(cls, recipe)(recipe)
    return [
        _one(trainer, Plan.from_dict(item["plan"]), item.get("rows"), item.get("routing"))
        for item in request["traces"]
    ]


def _one(trainer: Trainer, plan: Plan, rows: int | None, routing: dict[str, Any] | None) -> dict[str, Any]:
    rule = rule_from(routing or ({"imbalance": 1.0} if plan.shape.ep > 1 else None))  # never the fake counts
    try:
        with counts_from(rule) if rule is not None else contextlib.nullcontext():
            report = trace_step(trainer, plan, rows)
    except MemtrainError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # a model or strategy the fake step cannot run: the planner's formula
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {"error": f"{type(exc).__name__}: {first}"}
    return {
        "peak": report.peak_bytes,
        "at_peak": report.at_peak,
        "maxima": report.component_peaks,
        "where": f"{report.peak_phase} {report.peak_module}".strip(),
    }


def main(argv: list[str]) -> int:
    request_path, result_path = (Path(a) for a in argv)
    request = json.loads(request_path.read_text())
    Path(result_path).write_text(json.dumps({"traces": run(request)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
