"""`memtrain` commands run one after another in one torchrun launch, for tests that need several multi-rank
runs: a launch costs 6-8 s on the 2-core CI machine (the launcher's and each rank's imports).

    torchrun --nproc_per_node=2 tests/cli_jobs.py JOBS.json     # JOBS.json: a list of `memtrain` argv lists

The process group is created here, before the first command: each command joins it and leaves it standing
(`DistEnv.group_before`), and it is destroyed after the last. The first command that fails ends the launch
with its exit code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from memtrain.cli import main


def run(jobs: list[list[str]]) -> int:
    dist.init_process_group("gloo")
    try:
        for argv in jobs:
            code = main(argv)
            if code != 0:
                return code
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text())))
