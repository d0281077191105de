"""Startup time: seconds from launching `python -m memtrain ...` to its first line of output, for the commands
a user runs before anything trains (`validate`, `plan --help`), median of `--repeats` runs.

Why: every command used to spend seconds importing what it never used (the strategy catalog pulled
torch.distributed.optim, and through it FSDP and dynamo, for one isinstance check). `--src` compares
source trees (e.g. an older checkout's `src`) in interleaved runs on the same machine, so a busy machine
slows both alike; `python -c "import torch"` is the floor no memtrain command can go under.

    python scripts/bench_startup.py                                  # this checkout
    python scripts/bench_startup.py --src /tmp/old/src --src src     # before / after, interleaved
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "import torch (floor)": ["-c", "import torch; print('ok')"],
    "memtrain plan --help": ["-m", "memtrain", "plan", "--help"],
    "memtrain validate recipes/default.yaml": ["-m", "memtrain", "validate", "recipes/default.yaml"],
}


def first_line_seconds(args: list[str], src: Path) -> float:
    """Seconds until the command prints its first line (it is then left to finish)."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE_DIR": "off"}
    started = time.perf_counter()
    with subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as child:
        assert child.stdout is not None
        line = child.stdout.readline()
        seconds = time.perf_counter() - started
        child.communicate()
    if not line or child.returncode != 0:
        raise SystemExit(f"{' '.join(args)} with {src} printed nothing or failed (exit {child.returncode})")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--src", type=Path, action="append", help="a src directory (repeatable; default: src)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per command and tree (default 3)")
    args = parser.parse_args()
    trees = [p.resolve() for p in (args.src or [REPO / "src"])]
    times: dict[tuple[str, Path], list[float]] = {}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            for src in trees:  # interleaved: a busy machine slows every tree alike
                times.setdefault((name, src), []).append(first_line_seconds(command, src))
    print("| command | " + " | ".join(str(src) for src in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for name in COMMANDS:
        cells = [f"{statistics.median(times[name, src]):.2f} s" for src in trees]
        print(f"| `{name}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
