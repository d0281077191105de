"""A plan's per-rank memory on a mesh, traced: the trainer's own step run as one rank of a fake process group.

Why a trace and not the formula: on a mesh the search's arithmetic divides model states by the shard group
and leaves activations whole (`MeshShape.state_ranks`), an over-prediction by what tensor parallelism
splits; what torch really keeps (FSDP2's gathers of tensor-parallel shards, the embedding's gradient whole on
each tensor rank, sequence-parallel activations, the vocabulary-parallel loss) is what runs. torch's fake
process group lets one process run rank r of N under fake tensors, so the trainer's own `apply_plan` and
`train_step` run there, under the tracker (`memtrain.training.rank_trace`), and the prediction is what the
tracker counts on that rank.

Which ranks: the busiest, the first rank of each pipeline stage (tensor, context and data coordinates 0:
FSDP2 gives rank 0 the larger shard of an uneven split; tensor ranks hold equal pieces of a plan that
divides); the plan's prediction is the highest of them.

Where it runs: `python -m memtrain.commands.rank_trace`, a process of its own per traced rank (the fake group
is process-global, and the planning process may be a rank of a real group), which rebuilds the trainer from
`ModelSpec.rebuild` and traces every plan asked for. Its cost is a process start (imports, the trainer's
data: seconds) and about a second per plan for a small model, so a search asks once for all its candidates
(`RankTraces`), and only up to `MAX_TRACED_PLANS` of them. What cannot be traced (a trainer without
`rebuild`, a step that fails under fake tensors) is an `Unsupported` naming why; the search then keeps the
formula and says so. Pipelines are traced too: their stages are built with the shapes they exchange
(`memtrain.strategies.pipeline`), so the schedule runs over the fake group's sends and receives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtrain.errors import Unsupported
from memtrain.memory.footprint import COMPONENTS, Footprint
from memtrain.mesh import MeshShape
from memtrain.plan import Plan
from memtrain.planner.memory_model import Prediction
from memtrain.planner.spec import ModelSpec

WORKER = "memtrain.commands.rank_trace"
MAX_TRACED_PLANS = 32  # a search with more candidates on a mesh keeps the formula (minutes of traces)
TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class RankTrace:
    """One rank's traced step: the components at its peak, each component's maximum, where it peaked."""

    rank: int
    at_peak: Footprint
    maxima: Footprint
    where: str

    @property
    def peak(self) -> int:
        return self.at_peak.peak

    def prediction(self, host_bytes: int = 0) -> Prediction:
        """As the search's `Prediction`, with `host_bytes` of data the trainer keeps in host memory added to
        `other` (a CPU target, where host memory is the device: the tracker counts the samples a step reads,
        the trace reads none)."""
        at_peak = self.at_peak.with_(other=self.at_peak.other + host_bytes)
        maxima = self.maxima.with_(other=self.maxima.other + host_bytes)
        return Prediction(at_peak, maxima, f"rank {self.rank}: {self.where}".strip())


def traced_ranks(mesh: MeshShape) -> list[int]:
    """The ranks a plan on `mesh` is traced on: the first of each pipeline stage (module docstring)."""
    return [stage * (mesh.size // mesh.pp) for stage in range(mesh.pp)]


def trace_rank(
    spec: ModelSpec,
    plan: Plan,
    rank: int | None = None,
    rows: int | None = None,
    routing: dict[str, Any] | None = None,
) -> RankTrace:
    """`plan`'s step on rank `rank` of its mesh (default: the busiest of `traced_ranks`), `rows` per
    data-parallel rank per step (default: the recipe's); `Unsupported` naming why it cannot be traced.
    `routing` (expert parallelism): how many rows the rank's experts receive, `{"imbalance": factor}` (the
    rank receives factor x its mean share, T·k·factor rows per MoE layer) or `{"calls": ...}` (a run's
    measured counts, `RoutingLog.calls`); without it the fake group's garbage counts are read as they come."""
    ranks = [rank] if rank is not None else traced_ranks(plan.shape)
    found = [_run(spec, plan.shape.size, r, [(plan, routing)], rows)[0] for r in ranks]
    failed = next((f for f in found if isinstance(f, Unsupported)), None)
    if failed is not None:
        raise failed
    return max((f for f in found if isinstance(f, RankTrace)), key=lambda f: f.peak)


def trace_routings(
    spec: ModelSpec, plan: Plan, rank: int, routings: Sequence[dict[str, Any] | None], rows: int | None = None
) -> list[RankTrace]:
    """`plan`'s step on rank `rank` once per routing of `routings` (`trace_rank`'s `routing`), all in one
    process of the rank trace; `Unsupported` naming why one cannot be traced."""
    found = _run(spec, plan.shape.size, rank, [(plan, routing) for routing in routings], rows)
    failed = next((f for f in found if isinstance(f, Unsupported)), None)
    if failed is not None:
        raise failed
    return [f for f in found if isinstance(f, RankTrace)]


class RankTraces:
    """A search's rank traces: every candidate's, asked for at once (one process per traced rank), each
    plan's busiest rank kept, or why it could not be traced."""

    def __init__(self, spec: ModelSpec, progress: Callable[[str], None]) -> None:
        self.spec, self.progress = spec, progress
        self._found: dict[str, RankTrace | Unsupported] = {}

    def trace(self, plans: Sequence[Plan]) -> None:
        """Trace every plan of `plans` not traced yet (all on one mesh)."""
        todo = list({p.digest(): p for p in plans if p.digest() not in self._found}.values())
        if not todo:
            return
        if len(todo) > MAX_TRACED_PLANS:
            why = Unsupported(f"{len(todo)} candidates on a mesh, more than the {MAX_TRACED_PLANS} it traces")
            self._found.update((p.digest(), why) for p in todo)
            self.progress(f"predicted by formula: {why}")
            return
        mesh = todo[0].shape
        self.progress(f"tracing {len(todo)} plan(s) as rank(s) {traced_ranks(mesh)} of {mesh.describe()}")
        per_rank = [
            _run(self.spec, mesh.size, rank, [(p, None) for p in todo]) for rank in traced_ranks(mesh)
        ]
        for index, plan in enumerate(todo):
            found = [traces[index] for traces in per_rank]
            failed = next((f for f in found if isinstance(f, Unsupported)), None)
            traced = [f for f in found if isinstance(f, RankTrace)]
            self._found[plan.digest()] = failed or max(traced, key=lambda f: f.peak)
        failures = [f for f in self._found.values() if isinstance(f, Unsupported)]
        if failures:
            self.progress(f"{len(failures)} plan(s) predicted by formula; the first: {failures[0]}")

    def get(self, plan: Plan) -> RankTrace:
        """`plan`'s traced busiest rank; `Unsupported` when it was not (or could not be) traced."""
        found = self._found.get(plan.digest()) or Unsupported("not traced")
        if isinstance(found, Unsupported):
            raise found
        return found


def _run(
    spec: ModelSpec,
    world_size: int,
    rank: int,
    asks: Sequence[tuple[Plan, dict[str, Any] | None]],
    rows: int | None = None,
) -> list[RankTrace | Unsupported]:
    """Each (plan, routing)'s step on `rank` of `world_size`, traced in a process of its own (`WORKER`)."""
    if spec.rebuild is None:
        failed = Unsupported(f"{spec.name}: its trainer cannot be built again in another process")
        return [failed for _ in asks]
    trainer, recipe = spec.rebuild
    request = {
        "trainer": trainer,
        "recipe": dict(recipe),
        "world_size": world_size,
        "rank": rank,
        "traces": [{"plan": plan.to_dict(), "rows": rows, "routing": routing} for plan, routing in asks],
    }
    with tempfile.TemporaryDirectory(prefix="memtrain-rank-trace-") as folder:
        asked, answered = Path(folder, "request.json"), Path(folder, "result.json")
        asked.write_text(json.dumps(request))
        done = subprocess.run(
            [sys.executable, "-m", WORKER, str(asked), str(answered)],
            env=_worker_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if done.returncode != 0 or not answered.exists():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            failed = Unsupported(f"the rank trace's process failed (exit {done.returncode}): {tail}")
            return [failed for _ in asks]
        results = json.loads(answered.read_text())["traces"]
    return [_result(rank, r) for r in results]


def _result(rank: int, found: dict[str, Any]) -> RankTrace | Unsupported:
    if "error" in found:
        return Unsupported(f"rank {rank} could not be traced: {found['error']}")
    return RankTrace(
        rank,
        Footprint(**{c: int(found["at_peak"][c]) for c in COMPONENTS}),
        Footprint(**{c: int(found["maxima"][c]) for c in COMPONENTS}),
        str(found["where"]),
    )


def _worker_env() -> dict[str, str]:
    """This process's environment with its import path (a trainer class found through `sys.path`, as the
    tests' are, is found there too) and no launcher variables (the worker is no rank of this run)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and Path(p).is_dir())
    return env
