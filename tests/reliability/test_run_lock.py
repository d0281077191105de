"""One writer per run directory (issue #15): two `memtrain train` processes on one run.output_dir, fresh
or `--resume auto`, leave exactly one training; the other exits 2 naming the holder, without a
traceback (under torchrun, on every rank); a lock left by a SIGKILLed holder is taken over."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memtrain import cli
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.training.metrics import read_metrics

from fault_kit.scenarios import (
    DDP_ENV,
    Launch,
    finish,
    in_process,
    launch,
    recipe_dict,
    start,
    train_cmd,
    write_recipe,
)
from helpers import tiny_recipe

STEPS = 60  # with a checkpoint every step: long enough for the second process to start meanwhile
SECTIONS: dict[str, dict[str, Any]] = {
    "train": {"steps": STEPS, "warmup_steps": 2, "lr": 1e-2},
    "checkpoint": {"every": 1, "keep": 2, "at_end": True},
}


def logged_steps(run: Path) -> list[int]:
    return [row["step"] for row in read_metrics(run / "metrics.jsonl")]


def wait_for_rows(run: Path, rows: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"{run}: {rows} rows were never logged")


def assert_names_holder(error: str, run: Path, pid: int) -> None:
    lines = [line for line in error.splitlines() if "error" in line]
    assert "Traceback" not in error and len(lines) == 1, error
    assert f"run.output_dir {run} is in use by pid {pid} on host " in lines[0], error
    assert "wait for it to finish or set run.output_dir to another directory" in lines[0]


def test_two_fresh_runs_started_together_leave_one_writer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(run, **SECTIONS))
    began = time.perf_counter()
    procs = [start(train_cmd(recipe)) for _ in range(2)]
    ends: list[tuple[Launch, int]] = [(finish(p, began), p.pid) for p in procs]

    assert sorted(str(end.rc) for end, _ in ends) == ["0", "2"], [end.tail() for end, _ in ends]
    (loser, _), (_, winner) = sorted(ends, key=lambda e: e[0].rc == 0)
    assert_names_holder(loser.output, run, winner)
    assert logged_steps(run) == list(range(1, STEPS + 1))


def test_resume_auto_while_another_resume_auto_trains_exits_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(run, **SECTIONS))
    rc, out, err = in_process(cli.main, ["train", str(recipe), "train.steps=2", "--no-progress"])
    assert rc == 0, out + err
    first = start(train_cmd(recipe, resume=True))
    try:
        wait_for_rows(run, 4, first)  # it holds the run directory and trains
        rc, _, err = in_process(cli.main, ["train", str(recipe), "--no-progress", "--resume", "auto"])
        assert rc == 2
        assert_names_holder(err, run, first.pid)
    finally:
        done = finish(first, time.perf_counter())
    assert done.rc == 0, done.tail()
    assert logged_steps(run) == list(range(1, STEPS + 1))


HOLD_AND_DIE = """
import fcntl, json, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.write(fd, json.dumps({"pid": os.getpid(), "host": "h", "since": "t", "command": "c"}).encode())
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_lock_of_a_sigkilled_holder_is_taken_over(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, train={"steps": 1})
    lock = tmp_path / "run" / ".memtrain.lock"
    lock.parent.mkdir()
    holder = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, str(lock)], check=False)
    assert holder.returncode == -signal.SIGKILL and json.loads(lock.read_text())["pid"]

    result = CausalLMTrainer(recipe).fit()

    assert result.steps_done == 1
    assert lock.read_text() == "", "released: no holder named any more"


@pytest.mark.distributed
def test_every_rank_stops_with_the_holder_named(tmp_path: Path) -> None:
    """Under torchrun only rank 0 locks; the ranks agree on its result, so rank 1 stops with the same
    error instead of waiting in the next collective."""
    from memtrain.run import lock as run_lock

    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "recipe.yaml", recipe_dict(run, strategies={"sharding": "ddp"}))
    held = run_lock.acquire(run)  # this process holds the run directory
    try:
        ended = launch(train_cmd(recipe, ranks=2), DDP_ENV, timeout=120)
    finally:
        held.release()
    assert ended.rc not in (0, None), ended.tail()  # None: a hang, killed at the timeout
    # both ranks write to one pipe: their lines may interleave without a newline between them
    said = re.findall(
        rf"(memtrain(?: \(rank 1\))?): error: run\.output_dir \S+ is in use by pid {os.getpid()} ",
        ended.output,
    )
    assert sorted(said) == ["memtrain", "memtrain (rank 1)"], ended.output
    assert not (run / "metrics.jsonl").exists()
