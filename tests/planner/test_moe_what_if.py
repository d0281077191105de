"""What-ifs for mixture-of-experts models from config.json alone (issue 40), on 8 x H100 80 GB.

torchtitan's DeepSeek-V3 16B configuration (torchtitan/models/deepseek_v3/train_configs/deepseek_v3_16b.toml:
FSDP over every rank, local batch 8, seq 4096, full activation checkpointing, AdamW, no expert parallelism)
runs out of memory on 8 x H100 80 GB (torchtitan #1789); DeepSeek-V2-Lite has its shapes (hidden 2048, 27
layers, 64 routed experts of 1408, top-6, vocabulary 102,400). Pinned the same, it must be predicted not to
fit, for it and for Qwen3-30B-A3B; left open (checkpointing, micro-batches, sharding and ep), a plan that fits
is shown with its mesh, the ep meshes carrying the routed load the busiest rank was planned for. Expected
values come from the config (parameters, top-k) and the recipe, not from the planner."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import pytest

from memtrain.cli import main

GiB = 2**30
TARGET = ["--mode", "pretrain", "--gpu", "h100-80gb", "--world-size", "8", "batch.global_size=64"]
TORCHTITAN = [  # deepseek_v3_16b.toml: local batch 8 x seq 4096 on each of 8 FSDP ranks, full AC, AdamW
    "batch.micro_size=8",
    "strategies.checkpointing=full",
    "strategies.optimizer_states=fp32",
    "strategies.sharding=zero3",
    "strategies.loss=standard",
]
OPEN = ["strategies.optimizer_states=fp32", "strategies.mesh.ep=auto"]
MODELS = {  # hub id -> (published parameters, experts each token picks: config.json)
    "deepseek-ai/DeepSeek-V2-Lite": (15.7e9, 6),
    "Qwen/Qwen3-30B-A3B": (30.5e9, 8),
}


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_torchtitans_default_does_not_fit_and_a_mesh_that_fits_is_shown(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    parameters, top_k = MODELS[model]
    rc, out, err = _run(["plan", "--model", model, *TARGET, *TORCHTITAN])
    assert rc == 2 and "no plan fits the memory budget" in err, (out, err[-2000:])
    closest = next(line for line in err.splitlines() if line.startswith("  weights "))
    states = float(closest.split("optimizer_states ")[1].split(" GiB")[0]) * GiB
    # AdamW's two fp32 moments of every parameter, sharded over 8 ranks (within 1% of the published count)
    assert abs(states / (8 * parameters / 8) - 1) < 0.01, closest

    rc, out, err = _run(["plan", "--model", model, *TARGET, *OPEN, "--json"])
    assert rc == 0, err[-3000:]
    document: dict[str, Any] = json.loads(out)
    chosen = document["chosen"]
    assert chosen is not None and chosen["fits"], document["fastest_misfit"]
    usable = document["budget"]["usable"]
    assert chosen["predicted"]["peak"] <= usable and chosen["mesh"]["dp_shard"] == 8
    by_ep = {row["mesh"]["ep"]: row for row in document["meshes"]}
    assert set(by_ep) >= {1, 2, 4, 8}, sorted(by_ep)  # the search scored every ep dividing 8 and the experts
    for ep, row in by_ep.items():
        experts = row["experts"]
        tokens = row["plan"]["micro_batch_size"] * 4096
        assert experts["routed_rows_mean"] == tokens * top_k
        busiest = tokens * top_k if ep == 1 else math.ceil(tokens * top_k * experts["max_load"])
        assert experts["routed_rows_busiest"] == busiest
        assert (experts["bytes_per_half_load"] > 0) == (ep > 1)
    assert "expert parallelism" in document["sources"]
