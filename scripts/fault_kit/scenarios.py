"""The fault scenarios behind `scripts/fault_suite.py` and tests/reliability/test_fault_suite_subset.py.

Why: "memtrain survives faults" is only worth something with numbers from real faults. Each scenario
injects one kind of fault at points drawn from a seed, checks the recovery the way a user meets it
(exit codes, messages, checkpoints on disk, metrics.jsonl, the final parameters) and returns an
`Outcome`: trials, passes, figures for the table, and one line per failure with what reproduces it.

kill -9, SIGTERM and a dead rank only mean something across a process boundary, so those runs are real
`memtrain train` / `torchrun` processes (`fault_kit.faults` is the launcher with faults). The
out-of-memory, NaN and corrupt-checkpoint checks that need no process boundary run in this process,
for speed. Every run is a tiny llama on the CPU in fp32 with one thread, so "equal" means bit for bit:
a resumed or recovered run is compared with an uninterrupted one by its metrics.jsonl rows and by the
final checkpoint's parameters and optimizer states.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import copy
import io
import json
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

import memtrain
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.run import checkpoints as ckpt
from memtrain.training.metrics import read_metrics

from fault_kit import faults
from fault_kit.faults import Fault, FaultTrainer, Harness, StepRecord, digest

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}
LAUNCH_TIMEOUT_S = 240.0
DDP_ENV = {"MEMTRAIN_COLLECTIVE_TIMEOUT_MIN": "0.5"}  # a hang in a 2-rank scenario ends in 30 s


@dataclass
class Outcome:
    """One scenario's result: a row of the table."""

    name: str
    injected: str  # what was injected, in words
    trials: int = 0
    passed: int = 0
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    log: list[tuple[str, bool]] = field(default_factory=list)  # every trial: what was injected, passed

    def record(self, problem: str | None, label: str) -> None:
        self.trials += 1
        self.log.append((label, problem is None))
        if problem is None:
            self.passed += 1
        else:
            self.failures.append(f"{label}: {problem}")

    def count(self, key: str, n: int = 1) -> None:
        self.figures[key] = self.figures.get(key, 0) + n

    @property
    def ok(self) -> bool:
        return self.trials > 0 and self.passed == self.trials and not self.failures


@contextlib.contextmanager
def timed(outcome: Outcome) -> Iterator[Outcome]:
    started = time.perf_counter()
    try:
        yield outcome
    finally:
        outcome.seconds = round(time.perf_counter() - started, 1)


# ---------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Launch:
    rc: int | None  # None: it did not end within its timeout (its process group was killed)
    output: str  # stdout and stderr together
    seconds: float

    def tail(self, chars: int = 600) -> str:
        """The lines that say what went wrong (errors, timeouts) and the end of the output."""
        marks = ("error", "Error", "Timed out", "Traceback", "exitcode")
        key_lines = [line for line in self.output.splitlines() if any(m in line for m in marks)][:12]
        return "\n".join(key_lines) + "\n...\n" + self.output[-chars:]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher variables, memtrain's sources first, one thread."""
    dropped = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("TORCHELASTIC")}
    src = str(Path(memtrain.__file__).resolve().parents[1])
    kit = str(Path(__file__).resolve().parents[1])  # scripts/, which holds this fault kit
    env["PYTHONPATH"] = os.pathsep.join((src, kit, env.get("PYTHONPATH", "")))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def start(cmd: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd,
        env=child_env(extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], started: float, timeout: float = LAUNCH_TIMEOUT_S) -> Launch:
    try:
        output, _ = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session start_new_session made: this launch only
        output, _ = proc.communicate()
        rc = None
    return Launch(rc, output, round(time.perf_counter() - started, 2))


def launch(
    cmd: list[str], extra_env: dict[str, str] | None = None, timeout: float = LAUNCH_TIMEOUT_S
) -> Launch:
    return finish(start(cmd, extra_env), time.perf_counter(), timeout)


def train_cmd(
    recipe: Path,
    *overrides: str,
    harness: Harness | None = None,
    resume: bool = False,
    ranks: int = 1,
    restarts: int = 0,
) -> list[str]:
    """`memtrain train` (with faults: through `fault_kit.faults`), under torchrun for ranks > 1."""
    module = ["-m", "fault_kit.faults", *harness.to_args()] if harness is not None else ["-m", "memtrain"]
    args = [
        *module,
        "train",
        str(recipe),
        *overrides,
        "--no-progress",
        *(["--resume", "auto"] if resume else []),
    ]
    if ranks == 1:
        return [sys.executable, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        f"--max-restarts={restarts}",
        *args,
    ]


def recipe_dict(run_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A tiny llama on variable-length synthetic data; `sections` are merged over the defaults."""
    raw: dict[str, Any] = {
        "run": {"name": "fault", "output_dir": str(run_dir), "seed": 3},
        "model": {"config": dict(TINY_LLAMA)},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic": {"num_samples": 256, "min_len": 4}},
        "batch": {"global_size": 8, "micro_size": 4},
        "train": {"steps": 8, "lr": 1e-2, "warmup_steps": 2},
        "checkpoint": {"every": 2, "keep": 2, "at_end": True},
        "output": {"progress": "off"},
        "strategies": {"precision": "fp32", "sharding": "none"},
    }
    for name, values in copy.deepcopy(sections).items():
        raw.setdefault(name, {}).update(values)
    return raw


def write_recipe(path: Path, raw: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------- checks


def metric_rows(run_dir: Path) -> list[tuple[Any, ...]]:
    """What must match an uninterrupted run: step, loss, gradient norm, learning rate, skipped."""
    return [
        (r["step"], r["loss"], r["grad_norm"], r["lr"], r["skipped"])
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def final_state(run_dir: Path) -> dict[str, Any]:
    newest = ckpt.find_checkpoint(run_dir / "checkpoints").path
    return {name: torch.load(newest / f"{name}.pt", weights_only=True) for name in ("model", "optimizer")}


def tree_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The first place where two nested states differ (tensors bit for bit), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return None if same else where
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where} (keys)"
        return next((d for k in a if (d := tree_difference(a[k], b[k], f"{where}.{k}")) is not None), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} (length)"
        pairs = enumerate(zip(a, b, strict=True))
        return next(
            (d for i, (x, y) in pairs if (d := tree_difference(x, y, f"{where}[{i}]")) is not None), None
        )
    return None if a == b else where


def run_difference(run_dir: Path, reference_dir: Path) -> str | None:
    """How `run_dir` differs from the uninterrupted `reference_dir` (metrics rows, final states)."""
    rows, expected = metric_rows(run_dir), metric_rows(reference_dir)
    if rows != expected:
        pairs = enumerate(zip(rows, expected, strict=False))
        first = next((i for i, (x, y) in pairs if x != y), min(len(rows), len(expected)))
        return (
            f"metrics.jsonl differs from the uninterrupted run from row {first + 1} "
            f"({len(rows)} rows, expected {len(expected)})"
        )
    where = tree_difference(final_state(run_dir), final_state(reference_dir))
    return None if where is None else f"final checkpoint differs from the uninterrupted run at {where}"


def audit_checkpoints(root: Path, template: dict[str, torch.Tensor]) -> str | None:
    """None when every checkpoint directory (not the staging ones) is whole: meta.json parses, every
    file loads with weights_only=True, and model.pt has the template's names and shapes."""
    if not root.is_dir():
        return None
    for entry in sorted(root.iterdir()):
        if not ckpt.STEP_DIR.match(entry.name):
            continue
        try:
            json.loads((entry / "meta.json").read_text())
            states = {f.name: torch.load(f, weights_only=True) for f in sorted(entry.glob("*.pt"))}
        except Exception as exc:  # any failure here is a checkpoint that looks complete but is not
            return f"{entry} looks complete but is not: {type(exc).__name__}: {exc}"
        model = states.get("model.pt")
        if model is None or {k: v.shape for k, v in model.items()} != {
            k: v.shape for k, v in template.items()
        }:
            return f"{entry / 'model.pt'} is missing or does not match the model"
    return None


# ---------------------------------------------------------------------------------------------- kill -9

KILL_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},  # dropout: the RNG state must resume too
    "train": {"steps": 10, "warmup_steps": 3, "lr": 1e-2},
}
KILL_SAVES = (2, 4, 6, 8, 10)  # checkpoint.every 2, at_end
KILL_PRUNES = (6, 8, 10)  # with keep 2, these saves delete an older checkpoint
CHECKPOINT_FILES = ("model.pt", "optimizer.pt", "rng_rank0.pt", "meta.json")


def draw_kill(rng: random.Random, after: int) -> Fault:
    """A kill point later than step `after`: mid-step (40%), mid-checkpoint-file (45%), mid-prune."""
    saves = [s for s in KILL_SAVES if s > after]
    prunes = [s for s in KILL_PRUNES if s > after]
    draw = rng.random()
    if draw < 0.4 or not saves:
        return Fault(
            "kill",
            step=rng.randint(after + 1, 10),
            micro=rng.randint(1, 2),
            phase=rng.choice(("forward", "backward")),
        )
    if draw < 0.85 or not prunes:
        file = rng.choice(CHECKPOINT_FILES)
        whole = file == "meta.json" and rng.random() < 0.3  # every byte written, not yet renamed
        return Fault(
            "kill",
            step=rng.choice(saves),
            phase="save",
            file=file,
            fraction=1.0 if whole else round(rng.random(), 3),
        )
    return Fault("kill", step=rng.choice(prunes), phase="prune")


def kill9(work: Path, trials: int, seed: int, jobs: int = 2, points: tuple[Fault, ...] = ()) -> Outcome:
    """SIGKILL at random points (1 or 2 per trial; or one trial per given point), then `--resume auto`:
    the run must resume from the newest whole checkpoint and end bit-identical to an uninterrupted run."""
    outcome = Outcome("kill -9", "SIGKILL mid-step / mid-checkpoint-file / mid-prune, then --resume auto")
    with timed(outcome):
        recipe = write_recipe(work / "kill9.yaml", recipe_dict(work / "reference", **KILL_SECTIONS))
        reference = launch(train_cmd(recipe))
        if reference.rc != 0:
            outcome.record(f"the uninterrupted run failed:\n{reference.tail()}", "reference")
            return outcome
        template = final_state(work / "reference")["model"]

        def trial(index: int) -> tuple[str | None, list[Fault], int]:
            rng = random.Random(f"{seed}-kill9-{index}")
            run = work / f"kill{index:02d}"
            after, kills, torn = 0, [], 0
            for _ in range(1 if points else 2 if rng.random() < 0.5 else 1):
                fault = points[index] if points else draw_kill(rng, after)
                kills.append(fault)
                died = launch(
                    train_cmd(recipe, f"run.output_dir={run}", harness=Harness((fault,)), resume=True)
                )
                if died.rc != -signal.SIGKILL:
                    return (
                        f"{fault.to_json()}: expected death by SIGKILL, got exit {died.rc}\n{died.tail()}",
                        kills,
                        torn,
                    )
                problem = audit_checkpoints(run / "checkpoints", template)
                if problem is not None:
                    return f"after {fault.to_json()}: {problem}", kills, torn
                torn += len(list((run / "checkpoints").glob("*.tmp")))
                listed = ckpt.list_checkpoints(run / "checkpoints")
                after = listed[-1].step if listed else 0
            resumed = launch(train_cmd(recipe, f"run.output_dir={run}", resume=True))
            if resumed.rc != 0:
                return f"the resume failed (exit {resumed.rc}):\n{resumed.tail()}", kills, torn
            found = re.search(r"resumed from \S+ at step (\d+)", resumed.output)
            if (int(found.group(1)) if found else 0) != after:
                return (
                    f"resumed at step {found.group(1) if found else 0}, the newest good checkpoint is {after}",
                    kills,
                    torn,
                )
            return run_difference(run, work / "reference"), kills, torn

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
            for index, (problem, kills, torn) in enumerate(pool.map(trial, range(len(points) or trials))):
                outcome.record(problem, f"trial {index} ({'; '.join(k.to_json() for k in kills)})")
                outcome.count("kills", len(kills))
                for kill in kills:
                    outcome.count(
                        {
                            "forward": "mid-step",
                            "backward": "mid-step",
                            "save": "mid-checkpoint-file",
                            "prune": "mid-prune",
                        }[kill.phase]
                    )
                outcome.count("torn staging dirs ignored", torn)
        outcome.figures["bit-exact resumes"] = outcome.passed
    return outcome


# ---------------------------------------------------------------------------------------------- OOM

OOM_SECTIONS: dict[str, dict[str, Any]] = {
    "batch": {"global_size": 16, "micro_size": 8},
    "train": {"steps": 10, "lr": 1e-2, "warmup_steps": 0},
    "checkpoint": {"every": 0, "at_end": False},
}


def ledger_problem(step: int, got: StepRecord, expected: StepRecord, injected: int) -> str | None:
    """Compare one step of a run with out-of-memory faults against the fault-free reference."""
    final, want = Counter(got.attempts[-1]), Counter(expected.attempts[-1])
    lost, doubled = sum((want - final).values()), sum(c - 1 for c in final.values() if c > 1)
    if lost or doubled or final != want:
        return f"step {step}: {lost} samples lost, {doubled} seen twice"
    if len(got.attempts) != injected + 1:
        return f"step {step}: {len(got.attempts)} attempts for {injected} out-of-memory errors"
    if got.params_after != expected.params_after or got.optimizer_after != expected.optimizer_after:
        return f"step {step}: parameters differ from the fault-free run with the same micro-batches"
    return None


def oom_faults(rng: random.Random, steps: int, count: int, micro_steps: int, ranks: int) -> list[Fault]:
    """`count` out-of-memory faults over `steps` steps (a second one in the retry now and then).

    On several ranks the last micro-step is excluded: that is the documented limit (see
    `Trainer._try_accumulate`), checked on its own by `oom_last_micro_step`."""
    chosen: list[Fault] = []
    for step in range(1, steps + 1):
        for attempt in (1, 2):
            if len(chosen) == count or (attempt == 2 and rng.random() > 0.3):
                break
            n = micro_steps * attempt  # the retry runs at half the micro-batch: twice the micro-steps
            points = [(m, p) for m in range(1, n + 1 if ranks == 1 else n) for p in ("forward", "backward")]
            micro, phase = rng.choice(points)
            chosen.append(
                Fault("oom", step=step, micro=micro, attempt=attempt, phase=phase, rank=rng.randrange(ranks))
            )
    return chosen


def oom_one_rank(work: Path, injections: int, seed: int) -> Outcome:
    """Out-of-memory errors injected in random micro-steps (forward or late backward) on one rank."""
    outcome = Outcome("OOM, 1 rank", "torch.OutOfMemoryError in a random micro-step's forward or backward")
    with timed(outcome):
        rng = random.Random(f"{seed}-oom")
        done, index = 0, 0
        while done < injections:
            chosen = oom_faults(rng, 10, min(10, injections - done), 2, 1)
            trainer = FaultTrainer(
                CausalLMRecipe.from_dict(recipe_dict(work / f"oom{index}", **OOM_SECTIONS)),
                Harness(tuple(chosen), reset_micro=True),
            )
            trainer.fit()
            schedule = {s: r.micro_batch_size for s, r in trainer.ledger.items()}
            reference = FaultTrainer(
                CausalLMRecipe.from_dict(recipe_dict(work / f"oom{index}-ref", **OOM_SECTIONS)),
                Harness(micro_schedule=schedule),
            )
            reference.fit()
            for fault in chosen:
                injected = sum(1 for f in chosen if f.step == fault.step)
                problem = ledger_problem(
                    fault.step, trainer.ledger[fault.step], reference.ledger[fault.step], injected
                )
                outcome.record(problem, fault.to_json())
                outcome.count(f"in {fault.phase}")
            outcome.count(
                "samples lost", sum(_lost(trainer.ledger[s], reference.ledger[s]) for s in trainer.ledger)
            )
            outcome.count("samples seen twice", sum(_doubled(trainer.ledger[s]) for s in trainer.ledger))
            outcome.count("OOM events recovered", len(trainer.monitor.oom_events))
            done, index = done + len(chosen), index + 1
    return outcome


def _lost(got: StepRecord, expected: StepRecord) -> int:
    return sum((Counter(expected.attempts[-1]) - Counter(got.attempts[-1])).values())


def _doubled(got: StepRecord) -> int:
    return sum(c - 1 for c in Counter(got.attempts[-1]).values() if c > 1)


def oom_budget(work: Path, trials: int, seed: int) -> Outcome:
    """A real out-of-memory error from the simulated device budget (`memory.budget`), set between the
    peaks of two micro-batch sizes: the run must halve its micro-batch and lose nothing."""
    outcome = Outcome("OOM, simulated budget", "memory.budget between the peaks of micro-batch m/2 and m")
    with timed(outcome):
        rng = random.Random(f"{seed}-budget")
        for index in range(trials):
            size = rng.choice((8, 16))
            sections = {
                **OOM_SECTIONS,
                "batch": {"global_size": size, "micro_size": size},
                "train": {**OOM_SECTIONS["train"], "steps": 3},
            }
            peaks = {}
            for micro in (size, size // 2):  # tracked runs as long as the real one: states grow after step 1
                probe = FaultTrainer(
                    CausalLMRecipe.from_dict(
                        recipe_dict(
                            work / f"budget{index}-probe{micro}",
                            memory={"track": True},
                            **{**sections, "batch": {"global_size": size, "micro_size": micro}},
                        )
                    )
                )
                probe.fit()
                peaks[micro] = max(r.peak_bytes for r in probe.monitor.memory_reports)
            if peaks[size // 2] + 1 >= peaks[size]:
                outcome.record(
                    f"micro-batch {size // 2} peaks no lower than {size}: {peaks}", f"budget probe {index}"
                )
                continue
            budget = rng.randint(peaks[size // 2] + 1, peaks[size] - 1)
            trainer = FaultTrainer(
                CausalLMRecipe.from_dict(
                    recipe_dict(work / f"budget{index}", memory={"budget": budget}, **sections)
                )
            )
            trainer.fit()
            schedule = {s: r.micro_batch_size for s, r in trainer.ledger.items()}
            reference = FaultTrainer(
                CausalLMRecipe.from_dict(recipe_dict(work / f"budget{index}-ref", **sections)),
                Harness(micro_schedule=schedule),
            )
            reference.fit()
            events = trainer.monitor.oom_events
            problem = None
            if len(events) != 1 or "Simulated device out of memory" not in events[0]["error"]:
                problem = f"expected one simulated-device OOM, got {[e['error'][:60] for e in events]}"
            else:
                problem = next(
                    (
                        p
                        for s in trainer.ledger
                        if (
                            p := ledger_problem(
                                s, trainer.ledger[s], reference.ledger[s], int(s == events[0]["step"])
                            )
                        )
                        is not None
                    ),
                    None,
                )
            outcome.record(problem, f"budget {budget} B, global batch {size}, micro-batch {size}")
            outcome.count("OOM events recovered", len(events))
            outcome.count(
                "samples lost", sum(_lost(trainer.ledger[s], reference.ledger[s]) for s in trainer.ledger)
            )
            outcome.count("samples seen twice", sum(_doubled(trainer.ledger[s]) for s in trainer.ledger))
    return outcome


def _two_rank_ledgers(run_dir: Path) -> tuple[dict[int, StepRecord], dict[int, StepRecord]]:
    return faults.read_ledger(run_dir, 0), faults.read_ledger(run_dir, 1)


def oom_two_ranks(work: Path, injections: int, seed: int) -> Outcome:
    """Out-of-memory errors on a random rank of 2 (torchrun, DDP): both ranks must agree to redo the
    step every time (no hang, no collective mismatch), lose nothing, and match a fault-free run."""
    outcome = Outcome(
        "OOM, 2 ranks (DDP)", "torch.OutOfMemoryError on one rank, in any micro-step but the last"
    )
    with timed(outcome):
        rng = random.Random(f"{seed}-oom-ddp")
        done, index = 0, 0
        while done < injections:
            count = min(25, injections - done)
            chosen = oom_faults(rng, count, count, 2, 2)
            sections = {
                **OOM_SECTIONS,
                "train": {**OOM_SECTIONS["train"], "steps": max(f.step for f in chosen)},
                "batch": {"global_size": 16, "micro_size": 4},
                "strategies": {"sharding": "ddp"},
            }
            recipe = write_recipe(
                work / f"oomddp{index}.yaml", recipe_dict(work / f"oomddp{index}", **sections)
            )
            run = launch(
                train_cmd(recipe, harness=Harness(tuple(chosen), reset_micro=True), ranks=2), DDP_ENV
            )
            if run.rc != 0:
                for fault in chosen:
                    outcome.record(f"the 2-rank run failed (exit {run.rc}):\n{run.tail()}", fault.to_json())
                done, index = done + len(chosen), index + 1
                continue
            ranks = _two_rank_ledgers(work / f"oomddp{index}")
            schedule = {s: r.micro_batch_size for s, r in ranks[0].items()}
            ref_recipe = write_recipe(
                work / f"oomddp{index}-ref.yaml", recipe_dict(work / f"oomddp{index}-ref", **sections)
            )
            ref = launch(train_cmd(ref_recipe, harness=Harness(micro_schedule=schedule), ranks=2), DDP_ENV)
            refs = _two_rank_ledgers(work / f"oomddp{index}-ref") if ref.rc == 0 else None
            for fault in chosen:
                injected = sum(1 for f in chosen if f.step == fault.step)
                step = fault.step
                if refs is None:
                    problem: str | None = f"the fault-free 2-rank run failed:\n{ref.tail()}"
                elif len(ranks[0][step].attempts) != len(ranks[1][step].attempts):
                    problem = (
                        f"step {step}: the ranks disagree ({len(ranks[0][step].attempts)} vs "
                        f"{len(ranks[1][step].attempts)} attempts)"
                    )
                else:
                    problem = next(
                        (
                            p
                            for r in (0, 1)
                            if (p := ledger_problem(step, ranks[r][step], refs[r][step], injected))
                            is not None
                        ),
                        None,
                    )
                outcome.record(problem, fault.to_json())
                outcome.count(f"in {fault.phase}")
            outcome.count(
                "steps the ranks disagreed on",
                sum(len(ranks[0][s].attempts) != len(ranks[1][s].attempts) for s in ranks[0]),
            )
            if refs is not None:
                outcome.count(
                    "samples lost", sum(_lost(ranks[r][s], refs[r][s]) for r in (0, 1) for s in ranks[r])
                )
                outcome.count(
                    "samples seen twice", sum(_doubled(ranks[r][s]) for r in (0, 1) for s in ranks[r])
                )
            done, index = done + len(chosen), index + 1
    return outcome


def oom_last_micro_step(work: Path, trials: int, seed: int) -> Outcome:
    """The documented limit: an OOM inside the last micro-step on 2 ranks cannot be agreed on. It must
    end the job quickly with a clear error from the rank that failed, never a hang or a collective
    mismatch."""
    outcome = Outcome(
        "OOM in the last micro-step, 2 ranks", "the documented limit: a clear error, not a hang"
    )
    with timed(outcome):
        rng = random.Random(f"{seed}-oom-last")
        sections = {
            **OOM_SECTIONS,
            "batch": {"global_size": 16, "micro_size": 4},
            "strategies": {"sharding": "ddp"},
            "train": {**OOM_SECTIONS["train"], "steps": 4},
        }
        for index in range(trials):
            rank = rng.randrange(2)
            fault = Fault(
                "oom", step=rng.randint(1, 4), micro=2, phase=rng.choice(("forward", "backward")), rank=rank
            )
            recipe = write_recipe(
                work / f"oomlast{index}.yaml", recipe_dict(work / f"oomlast{index}", **sections)
            )
            run = launch(train_cmd(recipe, harness=Harness((fault,)), ranks=2), DDP_ENV, timeout=120)
            prefix = "memtrain: error" if rank == 0 else f"memtrain (rank {rank}): error"
            expected = f"{prefix}: out of memory on rank {rank} in the last micro-step of step {fault.step}"
            problem = None
            if run.rc is None:
                problem = f"hung (killed after {run.seconds} s)"
            elif run.rc == 0 or expected not in run.output:
                problem = f"expected exit != 0 and {expected!r}; got exit {run.rc}:\n{run.tail()}"
            elif "collective mismatch" in run.output or "doesn't match expected size" in run.output:
                problem = "a collective mismatch happened"
            outcome.record(problem, fault.to_json())
            outcome.figures["seconds to a clear error (max)"] = max(
                outcome.figures.get("seconds to a clear error (max)", 0.0), run.seconds
            )
    return outcome


def hung_rank(work: Path, seed: int) -> Outcome:
    """A rank that stops answering: its peer's collective must time out (MEMTRAIN_COLLECTIVE_TIMEOUT_MIN)
    and the job end with an error, not wait forever."""
    outcome = Outcome("hung rank, 2 ranks", "rank 1 sleeps 10 min mid-run; collective timeout 0.2 min")
    with timed(outcome):
        step = random.Random(f"{seed}-hang").randint(2, 4)
        recipe = write_recipe(work / "hang.yaml", recipe_dict(work / "hang", strategies={"sharding": "ddp"}))
        fault = Fault("hang", step=step, rank=1, seconds=600)
        run = launch(
            train_cmd(recipe, harness=Harness((fault,)), ranks=2),
            {"MEMTRAIN_COLLECTIVE_TIMEOUT_MIN": "0.2"},
            timeout=180,
        )
        problem = None
        if run.rc is None:
            problem = f"hung past {run.seconds} s"
        elif run.rc == 0 or "Timed out" not in run.output:
            problem = f"expected a collective timeout error; got exit {run.rc}:\n{run.tail()}"
        outcome.record(problem, fault.to_json())
        outcome.figures["seconds until the job ended"] = run.seconds
    return outcome


# ---------------------------------------------------------------------------------------------- NaN / inf


def nonfinite(work: Path, trials: int, seed: int) -> Outcome:
    """NaN/inf in the loss or a gradient on random steps: each such step is skipped and counted and
    leaves parameters and optimizer states bit-identical; K in a row stop the run with a checkpoint."""
    outcome = Outcome("NaN/inf", "NaN or inf in the loss, inf in a gradient; then K=3 in a row")
    with timed(outcome):
        rng = random.Random(f"{seed}-nan")
        sections = {
            "train": {"steps": 10, "lr": 1e-2, "max_bad_steps": 3},
            "checkpoint": {"every": 0, "at_end": False},
        }
        for index in range(trials):
            bad = sorted(rng.sample(range(1, 11), rng.randint(1, 3)))
            if bad == list(range(bad[0], bad[0] + 3)):
                bad = bad[:2]  # three in a row would stop the run: that is the next check
            chosen = tuple(Fault(rng.choice(("nan", "inf", "inf_grad")), step=s) for s in bad)
            trainer = FaultTrainer(
                CausalLMRecipe.from_dict(recipe_dict(work / f"nan{index}", **sections)), Harness(chosen)
            )
            trainer.fit()
            for fault in chosen:
                record = trainer.ledger[fault.step]
                problem = None
                if not record.skipped:
                    problem = "not skipped"
                elif (
                    record.params_before != record.params_after
                    or record.optimizer_before != record.optimizer_after
                ):
                    problem = "parameters or optimizer states changed"
                outcome.record(problem, f"trial {index}: {fault.to_json()}")
                outcome.count(f"in {'gradient' if fault.kind == 'inf_grad' else 'loss'}")
            good = [s for s in trainer.ledger if s not in bad]
            if trainer.skipped_steps != len(bad) or any(trainer.ledger[s].skipped for s in good):
                outcome.record(
                    f"skipped_steps {trainer.skipped_steps}, expected {len(bad)}", f"trial {index}"
                )
        for index in range(max(1, trials // 3)):
            first = rng.randint(2, 6)
            chosen = tuple(
                Fault(rng.choice(("nan", "inf", "inf_grad")), step=s) for s in range(first, first + 3)
            )
            outcome.record(
                _stops_after_k(work / f"nan-stop{index}", sections, chosen), f"K in a row from step {first}"
            )
            outcome.count("stops after K in a row")
    return outcome


def _stops_after_k(
    run_dir: Path, sections: dict[str, dict[str, Any]], chosen: tuple[Fault, ...]
) -> str | None:
    recipe = write_recipe(run_dir.with_suffix(".yaml"), recipe_dict(run_dir, **sections))
    rc, out, err = in_process(faults.main, [*Harness(chosen).to_args(), "train", str(recipe)])
    last = chosen[-1].step
    if rc != 3 or "3 steps in a row" not in err or f"stopped at step {last}" not in err or "Traceback" in err:
        return f"expected exit 3 and a message naming 3 steps in a row, step {last}; got {rc}: {err[-600:]}"
    newest = ckpt.find_checkpoint(run_dir / "checkpoints")
    if newest.step != last:
        return f"the checkpoint is at step {newest.step}, expected {last}"
    before = faults.read_ledger(run_dir)[chosen[0].step].params_before
    state = torch.load(newest.path / "model.pt", weights_only=True)
    if digest(v for _, v in sorted(state.items())) != before:
        return "the checkpoint's parameters are not those from before the bad steps"
    return None


def in_process(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int | str, str, str]:
    """(exit code, stdout, stderr) of a command-line `main` run here; an escaping exception becomes its
    type name in place of the exit code (a traceback the user would have seen)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc: int | str = main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - any escape is what this reports
            rc = f"Traceback: {type(exc).__name__}: {exc}"
    return rc, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------- SIGTERM

SIGTERM_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},
    "train": {"steps": 12, "warmup_steps": 2, "lr": 1e-2},
    "checkpoint": {"every": 4, "keep": 2, "at_end": True},
}


def sigterm(work: Path, trials: int, seed: int, ranks: int = 1) -> Outcome:
    """SIGTERM to a running `memtrain train` (or to torchrun, which forwards it to every rank) at a random
    step: a checkpoint after the step in flight, exit 0, and `--resume` continues bit-identically."""
    name = "SIGTERM" if ranks == 1 else f"SIGTERM, {ranks} ranks (to torchrun)"
    outcome = Outcome(name, "SIGTERM while a step runs, then --resume auto")
    with timed(outcome):
        sections = {**SIGTERM_SECTIONS, "strategies": {"sharding": "ddp" if ranks > 1 else "none"}}
        tag = f"sigterm{ranks}"
        recipe = write_recipe(work / f"{tag}.yaml", recipe_dict(work / f"{tag}-reference", **sections))
        reference = launch(train_cmd(recipe, ranks=ranks), DDP_ENV)
        if reference.rc != 0:
            outcome.record(f"the uninterrupted run failed:\n{reference.tail()}", "reference")
            return outcome
        rng = random.Random(f"{seed}-{tag}")
        for index in range(trials):
            run = work / f"{tag}-{index}"
            target = rng.randint(2, 9)
            delay = Harness((Fault("delay", rank=-1, seconds=0.15),))
            started = time.perf_counter()
            proc = start(train_cmd(recipe, f"run.output_dir={run}", harness=delay, ranks=ranks), DDP_ENV)
            seen = _wait_for_rows(run / "metrics.jsonl", target, proc, timeout=120)
            proc.send_signal(signal.SIGTERM)
            stopped = finish(proc, started)
            problem = _check_preempted(run, stopped, seen, ranks)
            if problem is None:
                resumed = launch(
                    train_cmd(recipe, f"run.output_dir={run}", resume=True, ranks=ranks), DDP_ENV
                )
                problem = (
                    run_difference(run, work / f"{tag}-reference")
                    if resumed.rc == 0
                    else f"the resume failed (exit {resumed.rc}):\n{resumed.tail()}"
                )
            outcome.record(problem, f"trial {index}: SIGTERM after {seen} logged steps")
        outcome.figures["bit-exact resumes"] = outcome.passed
    return outcome


def _wait_for_rows(path: Path, rows: int, proc: subprocess.Popen[str], timeout: float) -> int:
    """Wait until metrics.jsonl holds `rows` rows (or the process ended); return the rows seen."""
    deadline = time.perf_counter() + timeout
    seen = 0
    while time.perf_counter() < deadline and proc.poll() is None:
        seen = len(path.read_text().splitlines()) if path.is_file() else 0
        if seen >= rows:
            break
        time.sleep(0.02)
    return seen


def _check_preempted(run: Path, stopped: Launch, seen: int, ranks: int) -> str | None:
    found = re.search(r"SIGTERM: stopped after step (\d+) with a checkpoint", stopped.output)
    if found is None:
        return f"no preemption message (exit {stopped.rc}):\n{stopped.tail()}"
    step = int(found.group(1))
    if ranks == 1 and stopped.rc != 0:
        return f"exit {stopped.rc} after the preemption checkpoint, expected 0"
    if ranks > 1 and "this run)" not in stopped.output:
        return "rank 0 did not end its run normally after the checkpoint"
    if step - seen not in (0, 1):
        return f"stopped after step {step}, but {seen} steps were logged when SIGTERM was sent"
    newest = ckpt.find_checkpoint(run / "checkpoints")
    return None if newest.step == step else f"the newest checkpoint is step {newest.step}, expected {step}"


# ---------------------------------------------------------------------------------------------- corrupt

CORRUPT_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},
    "train": {"steps": 8, "warmup_steps": 2, "lr": 1e-2},
    "checkpoint": {"every": 2, "keep": 3, "at_end": True},  # checkpoints 4, 6 and 8
}


class _Boom:
    """Unpickling this would create a file: proof that a loader ran arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _truncate(path: Path, rng: random.Random) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: rng.randrange(len(data))])


def _wrong_shape(path: Path, rng: random.Random) -> None:
    state = torch.load(path, weights_only=True)
    if path.name == "model.pt":
        name = rng.choice(sorted(state))
        state[name] = torch.zeros(3, 3)
    else:  # an optimizer state of one parameter
        index = rng.choice(sorted(state["state"]))
        state["state"][index]["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, path)


def corruption_cases(
    other: Path, marker: Path
) -> dict[str, tuple[str, Callable[[Path, random.Random], None]]]:
    """name -> (file in the newest checkpoint, how to damage it)."""
    other_step = ckpt.find_checkpoint(other / "checkpoints").path

    def write(data: bytes) -> Callable[[Path, random.Random], None]:
        return lambda path, rng: path.write_bytes(data)

    def copy_from_other(path: Path, rng: random.Random) -> None:
        shutil.copyfile(other_step / path.name, path)

    def whole_other(path: Path, rng: random.Random) -> None:
        for item in other_step.iterdir():
            shutil.copyfile(item, path.parent / item.name)

    def pickle_bomb(path: Path, rng: random.Random) -> None:
        path.write_bytes(pickle.dumps({"model": _Boom(marker)}))

    def missing(path: Path, rng: random.Random) -> None:
        path.unlink()

    cases: dict[str, tuple[str, Callable[[Path, random.Random], None]]] = {
        f"truncated {f}": (f, _truncate) for f in ("model.pt", "optimizer.pt", "rng_rank0.pt")
    }
    cases |= {f"missing {f}": (f, missing) for f in CHECKPOINT_FILES}
    cases |= {
        "empty model.pt": ("model.pt", write(b"")),
        "wrong shapes in model.pt": ("model.pt", _wrong_shape),
        "wrong shapes in optimizer.pt": ("optimizer.pt", _wrong_shape),
        "other model's model.pt": ("model.pt", copy_from_other),
        "other model's optimizer.pt": ("optimizer.pt", copy_from_other),
        "other model's checkpoint": ("meta.json", whole_other),
        "garbage meta.json": ("meta.json", write(bytes(range(256)) * 4)),
        "meta.json not an object": ("meta.json", write(b"[1, 2, 3]")),
        "meta.json wrong types": ("meta.json", write(b'{"step": "eight", "plan": 5, "skipped_steps": "x"}')),
        "garbage rng_rank0.pt": ("rng_rank0.pt", lambda p, r: torch.save({"torch": torch.zeros(3)}, p)),
        "pickle with code in model.pt": ("model.pt", pickle_bomb),
    }
    return cases


def corrupt(work: Path, seed: int, only: int | None = None) -> Outcome:
    """Damage the newest checkpoint's files, then resume: without `checkpoint.fallback` a clear error
    naming the file (exit 2, no traceback); with it, the previous checkpoint, and a result bit-identical
    to the undamaged run. No loader may run code from a checkpoint."""
    outcome = Outcome(
        "corrupt checkpoint", "truncated / wrong shapes / other model / garbage meta / missing / pickle"
    )
    with timed(outcome):
        from memtrain import cli

        recipe = write_recipe(work / "corrupt.yaml", recipe_dict(work / "pristine", **CORRUPT_SECTIONS))
        other_recipe = write_recipe(
            work / "other.yaml",
            recipe_dict(
                work / "other", **{**CORRUPT_SECTIONS, "model": {"config": {**TINY_LLAMA, "hidden_size": 48}}}
            ),
        )
        for path, overrides in ((recipe, []), (other_recipe, ["train.steps=2"])):
            rc, _, err = in_process(cli.main, ["train", str(path), *overrides, "--no-progress"])
            if rc != 0:
                outcome.record(f"a setup run failed: {rc} {err[-600:]}", str(path))
                return outcome
        marker = work / "code-ran"
        rng = random.Random(f"{seed}-corrupt")
        cases = list(corruption_cases(work / "other", marker).items())
        for name, (file, damage) in cases if only is None else rng.sample(cases, only):
            slug = re.sub(r"\W+", "-", name)
            run = work / f"corrupt-{slug}"
            shutil.copytree(work / "pristine", run)
            newest = ckpt.step_dir_name(8)
            damage(run / "checkpoints" / newest / file, rng)
            args = ["train", str(recipe), f"run.output_dir={run}"]
            rc, _, err = in_process(cli.main, [*args, "--no-progress", "--resume"])
            named = str(run / "checkpoints" / newest)
            problem = None
            if rc != 2 or named not in err or "Traceback" in err:
                problem = (
                    f"without fallback: expected exit 2 and an error naming {named}; got {rc}: {err[-500:]}"
                )
            else:
                outcome.count("clear errors naming the file")
                rc, out, err = in_process(
                    cli.main, [*args, "checkpoint.fallback=true", "--no-progress", "--resume"]
                )
                if rc != 0 or "falling back to" not in out or "at step 6" not in out:
                    problem = f"with fallback: expected a resume from step 6; got {rc}: {(out + err)[-600:]}"
                else:
                    outcome.count("fallbacks to the previous checkpoint")
                    problem = run_difference(run, work / "pristine")
            if marker.exists():
                problem = "loading ran code from the checkpoint (the pickle's payload executed)"
            outcome.record(problem, name)
        outcome.figures["torch.load without weights_only=True in memtrain"] = len(unsafe_loads())
        if outcome.figures["torch.load without weights_only=True in memtrain"]:
            outcome.record(f"unsafe loads: {unsafe_loads()}", "static check")
    return outcome


def unsafe_loads() -> list[str]:
    """Calls in memtrain that could unpickle arbitrary objects: `torch.load` without `weights_only=True`,
    `pickle.load` / `pickle.loads` (read from the code, not its docstrings, which name them to say why)."""
    found = []
    for path in sorted(Path(memtrain.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and _unpickles(node):
                found.append(f"{path.name}:{node.lineno}")
    return found


def _unpickles(call: ast.Call) -> bool:
    name = ast.unparse(call.func)
    if name in ("pickle.load", "pickle.loads"):
        return True
    if name != "torch.load":
        return False
    weights_only = [k.value for k in call.keywords if k.arg == "weights_only"]
    return not (weights_only and isinstance(weights_only[0], ast.Constant) and weights_only[0].value is True)


def corrupt_two_ranks(work: Path, seed: int) -> Outcome:
    """A checkpoint one rank cannot read (its own RNG file truncated), 2 ranks with fallback: the ranks
    must agree on the checkpoint they resume from and end bit-identical to the undamaged run."""
    outcome = Outcome("corrupt checkpoint, 2 ranks", "rng_rank1.pt truncated, checkpoint.fallback=true")
    with timed(outcome):
        sections = {**CORRUPT_SECTIONS, "strategies": {"sharding": "ddp"}}
        recipe = write_recipe(work / "corrupt-ddp.yaml", recipe_dict(work / "pristine-ddp", **sections))
        pristine = launch(train_cmd(recipe, ranks=2), DDP_ENV)
        if pristine.rc != 0:
            outcome.record(f"the undamaged run failed:\n{pristine.tail()}", "setup")
            return outcome
        run = work / "corrupt-ddp"
        shutil.copytree(work / "pristine-ddp", run)
        _truncate(run / "checkpoints" / ckpt.step_dir_name(8) / "rng_rank1.pt", random.Random(f"{seed}-ddp"))
        resumed = launch(
            train_cmd(recipe, f"run.output_dir={run}", "checkpoint.fallback=true", resume=True, ranks=2),
            DDP_ENV,
            timeout=120,
        )
        if resumed.rc != 0:
            problem: str | None = f"exit {resumed.rc}:\n{resumed.tail()}"
        elif "at step 6" not in resumed.output:
            problem = f"did not resume from step 6:\n{resumed.tail()}"
        else:
            problem = run_difference(run, work / "pristine-ddp")
        outcome.record(problem, "rng_rank1.pt of step 8 truncated")
        outcome.figures["both ranks fell back to step 6, bit-exact"] = outcome.passed
    return outcome


# ---------------------------------------------------------------------------------------------- dead rank

DEAD_SECTIONS: dict[str, dict[str, Any]] = {
    "model": {"config": {**TINY_LLAMA, "attention_dropout": 0.1}},
    "batch": {"global_size": 8, "micro_size": 2},  # 2 micro-steps per rank: a kill can land in either
    "train": {"steps": 8, "warmup_steps": 2, "lr": 1e-2},
    "strategies": {"sharding": "ddp"},
}


def dead_rank(work: Path, trials: int, seed: int) -> Outcome:
    """One rank of 2 dies abruptly (SIGKILL) once, under `torchrun --max-restarts=1 ... --resume auto`:
    the group restarts from the last checkpoint and ends bit-identical to an uninterrupted run."""
    outcome = Outcome("dead rank, 2 ranks", "one rank SIGKILLed once under torchrun --max-restarts=1")
    with timed(outcome):
        recipe = write_recipe(work / "dead.yaml", recipe_dict(work / "dead-reference", **DEAD_SECTIONS))
        reference = launch(train_cmd(recipe, ranks=2), DDP_ENV)
        if reference.rc != 0:
            outcome.record(f"the uninterrupted run failed:\n{reference.tail()}", "reference")
            return outcome
        rng = random.Random(f"{seed}-dead")
        for index in range(trials):
            fault = Fault(
                "kill",
                step=rng.randint(1, 8),
                micro=rng.randint(1, 2),
                phase=rng.choice(("forward", "backward")),
                rank=rng.randrange(2),
            )
            run = work / f"dead{index}"
            result = launch(
                train_cmd(
                    recipe,
                    f"run.output_dir={run}",
                    harness=Harness((fault,)),
                    resume=True,
                    ranks=2,
                    restarts=1,
                ),
                DDP_ENV,
            )
            if result.rc != 0:
                problem: str | None = f"exit {result.rc}:\n{result.tail()}"
            elif result.output.count("[memtrain] plan:") != 2:
                problem = "the group did not restart exactly once"
            else:
                problem = run_difference(run, work / "dead-reference")
            outcome.record(problem, fault.to_json())
        outcome.figures["bit-exact after restart"] = outcome.passed
    return outcome
