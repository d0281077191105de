"""DDP on 2 gloo processes (launched by torchrun) matches one process on the same global batch.

Tolerance: the two runs add the same per-token gradients in a different order (two ranks each
accumulate half the micro-batches, then gloo sums the halves), so fp32 results agree to rounding only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memtrain.training.metrics import read_metrics

from helpers import REPO, subprocess_env

RECIPE = "recipes/tests/tiny-ddp.yaml"


def _run(args: list[str]) -> None:
    done = subprocess.run(args, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def _final(run_dir: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [row["loss"] for row in read_metrics(run_dir / "metrics.jsonl")]
    state = torch.load(run_dir / "checkpoints/step_00000006/model.pt", weights_only=True)
    return losses, state


@pytest.mark.distributed
def test_ddp_two_ranks_matches_single_process(tmp_path: Path) -> None:
    single, double = tmp_path / "single", tmp_path / "ddp"
    _run(
        [
            sys.executable,
            "-m",
            "memtrain",
            "train",
            RECIPE,
            f"run.output_dir={single}",
            "strategies.sharding=none",
        ]
    )
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "memtrain",
            "train",
            RECIPE,
            f"run.output_dir={double}",
        ]
    )
    assert '"world_size": 2' in (double / "plan.json").read_text()
    losses_1, state_1 = _final(single)
    losses_2, state_2 = _final(double)
    assert losses_1[-1] < losses_1[0]
    assert losses_2 == pytest.approx(losses_1, rel=1e-5)
    for name, value in state_1.items():
        torch.testing.assert_close(state_2[name], value, atol=2e-5, rtol=1e-4, msg=name)
