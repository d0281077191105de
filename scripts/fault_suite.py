"""The fault-injection suite: kill -9, OOM, NaN/inf, SIGTERM and Ctrl-C, every stop signal at every moment
(the signal matrix), corrupt checkpoints, a dead or hung rank, a dead launcher, rollbacks killed mid-way,
kills while a checkpoint is replaced or pruned, two writers on one run, a full disk, recipe fuzzing,
input bombs, undecodable files and planted pickles, each injected many times at points drawn from a seed.

Why a script (and not only tests): the issue asks for figures — how many faults of each kind were
injected and how many runs recovered exactly — from one reproducible run, to put in docs/RELIABILITY.md.
tests/reliability/test_fault_suite_subset.py runs a few of each kind in CI with the same scenario code
(`fault_kit.scenarios`), so the suite and the tests cannot drift apart.

    python scripts/fault_suite.py [--quick] [--out results/faults] [--seed 0]

prints a markdown table, writes `<out>/fault_suite.json` (every trial's failure with the fault that
reproduces it) and exits 1 if any trial failed. The full run takes about 15 minutes on 2 CPU cores,
`--quick` about 5.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: bit-exact comparisons need one thread

import argparse
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fault_kit import input_bombs, launcher_faults, lineage_faults, planted_pickles, run_dir_faults, scenarios
from fault_kit.recipe_fuzz import recipe_fuzz
from fault_kit.scenarios import Outcome

Scenario = Callable[[Path, int, int], Outcome]  # (work dir, seed, jobs) -> outcome


def plan(quick: bool) -> list[tuple[str, Scenario]]:
    """The scenarios and their sizes: the full run, or a quick one."""

    def n(full: int, fast: int) -> int:
        return fast if quick else full

    full = not quick  # a hung rank must wait out its timeout, and SIGTERM on 2 ranks is slow: full run only
    runs: list[tuple[str, Scenario]] = [
        ("kill9", lambda w, s, j: scenarios.kill9(w, n(20, 4), s, j)),
        ("oom", lambda w, s, j: scenarios.oom_one_rank(w, n(50, 20), s)),
        ("oom_budget", lambda w, s, j: scenarios.oom_budget(w, n(5, 1), s)),
        ("oom_ddp", lambda w, s, j: scenarios.oom_two_ranks(w, n(50, 8), s)),
        ("oom_last", lambda w, s, j: scenarios.oom_last_micro_step(w, n(2, 1), s)),
        *([("hung_rank", lambda w, s, j: scenarios.hung_rank(w, s))] if full else []),
        ("nan", lambda w, s, j: scenarios.nonfinite(w, n(10, 3), s)),
        ("sigterm", lambda w, s, j: scenarios.sigterm(w, n(5, 1), s)),
        *([("sigterm_ddp", lambda w, s, j: scenarios.sigterm(w, 2, s, ranks=2))] if full else []),
        ("corrupt", lambda w, s, j: scenarios.corrupt(w, s)),
        ("corrupt_ddp", lambda w, s, j: scenarios.corrupt_two_ranks(w, s)),
        ("dead_rank", lambda w, s, j: scenarios.dead_rank(w, n(3, 1), s)),
        ("fuzz", lambda w, s, j: recipe_fuzz(w, 200, s)),
        ("rollback_kill", lambda w, s, j: lineage_faults.rollback_kill(w, n(12, 4), s)),
        ("replace_kill", lambda w, s, j: lineage_faults.replace_kill(w, n(12, 3), s)),
        ("writers", lambda w, s, j: lineage_faults.concurrent_writers(w, n(6, 2), s)),
        ("disk_full", lambda w, s, j: lineage_faults.disk_full(w, n(24, 8), s)),
        ("ctrl_c", lambda w, s, j: launcher_faults.ctrl_c(w, n(5, 2), s)),
        ("launcher_death", lambda w, s, j: launcher_faults.launcher_death(w, n(3, 1), s)),
        ("signal_matrix", lambda w, s, j: launcher_faults.signal_matrix(w, n(25, 5), s)),
        ("input_bombs", lambda w, s, j: input_bombs.input_bombs(w, s)),
        ("undecodable", lambda w, s, j: input_bombs.undecodable_files(w, s)),
        ("planted_pickles", lambda w, s, j: planted_pickles.planted_pickles(w, s)),
        ("run_dir", lambda w, s, j: run_dir_faults.run_dir_faults(w, s)),
        ("inputs", lambda w, s, j: input_bombs.inputs(w, s)),
    ]
    return runs


def figures_text(figures: dict[str, object]) -> str:
    return "; ".join(f"{key}: {value}" for key, value in figures.items())


def table(outcomes: list[Outcome]) -> str:
    lines = [
        "| Fault | Injected | Trials | Recovered as required | Figures | Time (s) |",
        "|---|---|---:|---:|---|---:|",
    ]
    for o in outcomes:
        lines.append(
            f"| {o.name} | {o.injected} | {o.trials} | {o.passed}/{o.trials} | "
            f"{figures_text(o.figures)} | {o.seconds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials (under 3 minutes)")
    parser.add_argument(
        "--out", type=Path, default=Path("results/faults"), help="where fault_suite.json goes"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws every fault point")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel kill -9 trials")
    parser.add_argument("--only", nargs="*", default=None, metavar="NAME", help="run only these scenarios")
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories (printed at the end)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    selected = [(name, run) for name, run in plan(args.quick) if args.only is None or name in args.only]
    work = Path(tempfile.mkdtemp(prefix="memtrain-faults-"))
    command = "python scripts/fault_suite.py " + " ".join(argv if argv is not None else sys.argv[1:])
    started = time.perf_counter()
    outcomes = []
    for name, run in selected:
        print(f"[faults] {name} ...", file=sys.stderr, flush=True)
        (work / name).mkdir()
        outcome = run(work / name, args.seed, args.jobs)
        outcomes.append(outcome)
        status = "ok" if outcome.ok else f"{len(outcome.failures)} FAILED"
        print(
            f"[faults] {name}: {outcome.passed}/{outcome.trials} {status} in {outcome.seconds} s",
            file=sys.stderr,
            flush=True,
        )
    total = round(time.perf_counter() - started, 1)

    report = {
        "command": command.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seed": args.seed,
        "quick": args.quick,
        "seconds": total,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}",
        "ok": all(o.ok for o in outcomes),
        "scenarios": [vars(o) for o in outcomes],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fault_suite.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(outcomes))
    print(f"\n{report['command']} — {report['date']}, {total} s, {report['machine']}")
    for o in outcomes:
        for failure in o.failures:
            print(f"FAILED {o.name}: {failure}", file=sys.stderr)
    if args.keep:
        print(f"runs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
