"""The CPU benchmark's searches and timed runs for one tool: what a worker process does.

Why one search method for every tool: the tools' own searches differ (HF Trainer and accelerate retry at
0.9x the batch after an OOM, memtrain plans), so a figure from each tool's own search compares the
searches as much as the fit. Every metric therefore uses the same bisection for every tool over the same
candidates, each probe a short run (`probe_steps` steps) under the budget; the tools' own searches of
metric (b) run beside it and are reported next to it.

- (a) the largest model: ladder rungs (cpu_setup.rungs), one sequence of the base length per step;
- (b) the largest micro-batch among the divisors of the global batch, each probe at the global batch
  (accumulating: HF Trainer and memtrain hold a whole step's batch at once), then tokens/s at the
  global batch with that micro-batch and accumulation, in `time_tool`'s timed runs;
- (c) the longest sequence (cpu_setup.seq_lens), one sequence per step, base model.

Budgets run in increasing order and each search starts from the answer at the budget below (what fits
under a budget fits under a larger one), so a larger budget costs fewer probes. Fitting is counted in
bytes by the tracker, not timed: the searches are deterministic and run once; the timed runs repeat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from fit_kit.cpu_setup import (
    MEMTRAIN_TOOLS,
    CpuSetup,
    micro_sizes,
    model_config,
    parameters,
    rungs,
    seq_lens,
    shape,
)
from fit_kit.cpu_tools import Job, Outcome, run

Emit = Callable[[dict[str, Any]], None]


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool], known: int = -1) -> int:
    """The index of the largest candidate that fits (-1: none), by bisection; `known`: an index known to
    fit already. Assumes that a candidate fits when a larger one does."""
    low, high = known, len(candidates)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            low = middle
        else:
            high = middle
    return low


def search_tool(tool: str, setup: CpuSetup, budgets_bytes: Sequence[int], emit: Emit) -> None:
    """Metrics (a), (b) and (c) and the tool's own search of (b) at each budget; one record per budget."""
    micros, lengths = micro_sizes(setup), seq_lens(setup)
    known = {"batch": -1, "seq": -1}
    known_rung: int | None = None
    for pct, budget in zip(setup.budgets, budgets_bytes, strict=True):
        probes: dict[str, list[dict[str, Any]]] = {"batch": [], "model": [], "seq": []}

        def probe(
            metric: str, value: int, job: Job, probes: dict[str, list[dict[str, Any]]] = probes
        ) -> bool:
            outcome = run(tool, setup, job)
            probes[metric].append(
                {
                    "value": value,
                    "ok": outcome.ok,
                    "note": outcome.note,
                    "plan": outcome.plan,
                    "peak_bytes": outcome.peak_bytes,
                    "seconds": round(outcome.seconds, 2),
                }
            )
            return outcome.ok

        def short(
            rung: int = 0, seq_len: int = setup.seq_len, micro: int = 1, batch: int = 1, budget: int = budget
        ) -> Job:
            return Job(rung, seq_len, micro, batch, setup.probe_steps, budget, warmup=1)

        record: dict[str, Any] = {"budget_pct": pct, "budget_bytes": budget}
        index = largest_fitting(
            micros, lambda m: probe("batch", m, short(micro=m, batch=setup.global_batch)), known["batch"]
        )
        known["batch"] = index
        record["batch"] = answer(micros, index, "micro", probes["batch"])

        own = run(
            tool,
            setup,
            Job(
                0,
                setup.seq_len,
                None,
                setup.global_batch,
                setup.warmup + setup.steps,
                budget,
                warmup=setup.warmup,
            ),
        )
        record["own"] = dataclasses.asdict(own)

        ladder = rungs(setup, budget)
        start = ladder.index(known_rung) if known_rung in ladder else -1
        index = largest_fitting(ladder, lambda r: probe("model", r, short(rung=r)), start)
        known_rung = ladder[index] if index >= 0 else None
        record["model"] = answer(ladder, index, "rung", probes["model"])
        if index >= 0:
            config = model_config(setup, ladder[index])
            hidden, layers = shape(setup, ladder[index])
            record["model"].update(params=parameters(config), hidden=hidden, layers=layers)

        index = largest_fitting(lengths, lambda n: probe("seq", n, short(seq_len=n)), known["seq"])
        known["seq"] = index
        record["seq"] = answer(lengths, index, "seq_len", probes["seq"])
        record["probes"] = probes
        emit(record)


def answer(candidates: Sequence[int], index: int, name: str, probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The search's result: the value, whether it is the top candidate (the true maximum may be higher),
    or the reason the smallest candidate failed."""
    if not candidates:
        return {
            name: None,
            "note": "no candidate: the smallest model's fp32 weights and gradients pass the budget",
        }
    if index < 0:
        failed = next((p for p in probes if p["value"] == candidates[0]), None)
        why = failed["note"] if failed else "not probed"
        return {name: None, "note": f"even {name} {candidates[0]} does not train: {why}"}
    top = index == len(candidates) - 1
    return {
        name: candidates[index],
        "at_top": top,
        "note": "the top candidate: the true maximum may be higher" if top else "",
    }


def time_tool(tool: str, setup: CpuSetup, configs: Sequence[dict[str, Any]], emit: Emit) -> None:
    """Metric (b)'s timed runs: each config ({budget_pct, budget_bytes, method, micro}) trains the global
    batch for warmup + steps steps under its budget; one record per config."""
    for config in configs:
        outcome = run(
            tool,
            setup,
            Job(
                0,
                setup.seq_len,
                config["micro"],
                setup.global_batch,
                setup.warmup + setup.steps,
                config["budget_bytes"],
                warmup=setup.warmup,
            ),
        )
        emit({**config, **dataclasses.asdict(outcome)})


def reference_peak(setup: CpuSetup, tool: str) -> Outcome:
    """The unconstrained peak of a plain loop: the global batch in one micro-batch, no budget, as many
    steps as a timed run (on the CPU the data is on the device too: a few KiB more each step)."""
    return run(
        tool,
        setup,
        Job(0, setup.seq_len, setup.global_batch, setup.global_batch, setup.warmup + setup.steps, None),
    )


def timed_configs(tool: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    """What `time_tool` runs at one budget: the common search's micro-batch (every tool) and, for
    memtrain, its own choice (`auto`)."""
    base = {"budget_pct": record["budget_pct"], "budget_bytes": record["budget_bytes"]}
    configs = []
    if record["batch"].get("micro"):
        configs.append({**base, "method": "common", "micro": record["batch"]["micro"]})
    if tool in MEMTRAIN_TOOLS and record["own"]["ok"]:
        configs.append({**base, "method": "auto", "micro": None})
    return configs
