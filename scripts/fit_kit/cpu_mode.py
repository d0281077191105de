"""The CPU half of scripts/bench_fit_budget.py: every tool under memtrain's simulated budget, three metrics.

Why on the CPU: the fit claim ("more fits in the memory you have, at equal or better speed") was only
measurable on a GPU, which this project rarely has. `SimulatedBudget` refuses, with a real
`torch.OutOfMemoryError`, any allocation past a byte budget counted exactly as memtrain counts memory, so
every tool meets the same limit (see cpu_tools). The budgets are shares of the unconstrained peak, the
larger tracker peak of the plain HF Trainer and accelerate loops with the global batch in one micro-batch.

Order of work: the reference peak (one process per plain loop), then each tool's searches (one process
per tool, cpu_search.search_tool), then `reps` rounds of timed runs, one fresh process per tool and round,
the tools' order alternating between rounds so that drifts in machine load hit every tool alike.
`in_process` runs the same work in this process (the smoke test: one import instead of a dozen).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_vs_peers import quiet

from fit_kit import cpu_report
from fit_kit.cpu_search import reference_peak, search_tool, time_tool, timed_configs
from fit_kit.cpu_setup import MEMTRAIN_TOOLS, REFERENCE_TOOLS, CpuSetup, model_config, parameters
from fit_kit.cpu_tools import cache_planner_traces

SCRIPT = Path(__file__).resolve().parent.parent / "bench_fit_budget.py"
RESULT = "cpu-fit-result: "  # prefix of a worker's JSON lines (HF Trainer prints dicts of its own)


def work(task: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
    """One worker's task: {"kind": reference|search|time, "tool", "setup", and its inputs}."""
    setup = CpuSetup.from_json(task["setup"])
    tool = task["tool"]
    if tool in MEMTRAIN_TOOLS:
        cache_planner_traces()
    if task["kind"] == "reference":
        emit(dataclasses.asdict(reference_peak(setup, tool)))
    elif task["kind"] == "search":
        search_tool(tool, setup, task["budgets_bytes"], emit)
    else:
        time_tool(tool, setup, task["configs"], emit)


def worker_main(task_json: str) -> None:
    """The `--worker-task` entry of bench_fit_budget.py: records on stdout, one JSON line each."""
    task = json.loads(task_json)
    quiet()
    torch.set_num_threads(CpuSetup.from_json(task["setup"]).threads)
    work(task, lambda record: print(RESULT + json.dumps(record), flush=True))


class Runner:
    """Runs tasks in fresh processes (or in this one) and keeps each tool's failure to report."""

    def __init__(self, in_process: bool, threads: int) -> None:
        self.in_process = in_process
        self.threads = threads
        self.errors: dict[str, str] = {}

    def __call__(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        if self.in_process:
            work(task, records.append)
            return records
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        command = [sys.executable, str(SCRIPT), "--cpu", "--worker-task", json.dumps(task)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        records = [
            json.loads(line[len(RESULT) :]) for line in done.stdout.splitlines() if line.startswith(RESULT)
        ]
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
            self.errors[task["tool"]] = f"{task['kind']} worker exit {done.returncode}: {tail[0][:200]}"
            print(f"{task['tool']} {task['kind']}: {self.errors[task['tool']]}", file=sys.stderr, flush=True)
        return records


def run_cpu(setup: CpuSetup, tools: list[str], reps: int, in_process: bool = False) -> dict[str, Any]:
    """The whole benchmark; returns the result (JSON-ready) with its summary and tables."""
    started = time.perf_counter()
    runner = Runner(in_process, setup.threads)
    base = {"setup": setup.to_json()}

    reference = {t: runner({**base, "kind": "reference", "tool": t}) for t in REFERENCE_TOOLS}
    peaks = {t: r[0]["peak_bytes"] for t, r in reference.items() if r and r[0]["ok"]}
    if not peaks:
        raise RuntimeError(f"no reference run finished: {runner.errors or reference}")
    peak = max(peaks.values())
    budgets = [{"pct": pct, "bytes": round(peak * pct / 100)} for pct in setup.budgets]
    log(f"reference peak {peak / 2**20:.1f} MiB ({peaks}); budgets {[b['bytes'] for b in budgets]}")

    search: dict[str, list[dict[str, Any]]] = {}
    for tool in tools:
        search[tool] = runner(
            {**base, "kind": "search", "tool": tool, "budgets_bytes": [b["bytes"] for b in budgets]}
        )
        for r in search[tool]:
            log(
                f"{tool} at {r['budget_pct']}%: model {r['model'].get('rung')}, micro {r['batch'].get('micro')}, "
                f"seq {r['seq'].get('seq_len')}, own {r['own']['micro']}x{r['own']['accumulation']}"
            )

    timed: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
    for rep in range(reps):
        for tool in tools if rep % 2 == 0 else list(reversed(tools)):
            configs = [c for r in search[tool] for c in timed_configs(tool, r)]
            if configs:
                records = runner({**base, "kind": "time", "tool": tool, "configs": configs})
                timed[tool] += [{**r, "rep": rep} for r in records]
        log(f"timed round {rep + 1}/{reps} done")

    result: dict[str, Any] = {
        "mode": "cpu",
        "setup": dataclasses.asdict(setup),
        "reps": reps,
        "reference": {
            "peak_bytes": peak,
            "params": parameters(model_config(setup)),
            "by_tool": {t: r[0] if r else None for t, r in reference.items()},
        },
        "budgets": budgets,
        "search": search,
        "timed": timed,
        "errors": runner.errors,
        "environment": environment(setup),
    }
    result["summary"] = cpu_report.summarise(result)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def environment(setup: CpuSetup) -> dict[str, Any]:
    import accelerate
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cpus": os.cpu_count(),
        "threads_per_worker": setup.threads,
        "load_average": os.getloadavg(),
    }


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
