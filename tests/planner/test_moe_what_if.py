"""What-ifs for mixture-of-experts models from config.json alone (issue 40), on 8 x H100 80 GB.

torchtitan's DeepSeek-V3 16B configuration (torchtitan/models/deepseek_v3/train_configs/deepseek_v3_16b.toml:
FSDP over every rank, local batch 8, seq 4096, full activation checkpointing, AdamW, no expert parallelism)
runs out of memory on 8 x H100 80 GB (torchtitan #1789); DeepSeek-V2-Lite has its shapes (hidden 2048, 27
layers, 64 routed experts of 1408, top-6, vocabulary 102,400). Pinned the same, it must be predicted not to
fit, for it and for Qwen3-30B-A3B; left open (micro-batches, sharding and ep), a plan that fits
is shown with its mesh, the ep meshes carrying the routed load the busiest rank was planned for. Expected
values come from the config (parameters, top-k) and the recipe, not from the planner."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import main
from memtrain.cluster import Cluster, Link
from memtrain.commands.what_if import WhatIf, recipe
from memtrain.memory.headroom import load_gpu, what_if_target
from memtrain.planner.cost import SPEEDS, CostModel, DeviceSpeed
from memtrain.planner.mesh_explain import best_per_mesh
from memtrain.planner.mesh_search import search_meshes
from memtrain.planner.model_probe import ModelProbe

GiB = 2**30
CARDS = Path(__file__).resolve().parents[2] / "src/memtrain/causal_lm/shape_cards"
TARGET = ["--mode", "pretrain", "--gpu", "h100-80gb", "--world-size", "8", "batch.global_size=64"]
TORCHTITAN = [  # deepseek_v3_16b.toml: local batch 8 x seq 4096 on each of 8 FSDP ranks, full AC, AdamW
    "batch.micro_size=8",
    "strategies.checkpointing=full",
    "strategies.optimizer_states=fp32",
    "strategies.sharding=zero3",
    "strategies.loss=standard",
]
# micro-batches, sharding and ep left open; recompute and the loss pinned as torchtitan's (each other mode's
# traces would add a minute of CPU to a test about the mesh)
OPEN = [
    "strategies.optimizer_states=fp32",
    "strategies.checkpointing=full",
    "strategies.loss=standard",
    "strategies.mesh.ep=auto",
]
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


B200 = DeviceSpeed(  # ~60% of 2.25 PFLOP/s bf16 dense, HBM3e 8 TB/s; the rest as the H100 class (cost.py)
    **{
        **vars(SPEEDS["cuda"]),
        "matmul_flops": {"fp32": 100e12, "bf16": 1.35e15, "fp16": 1.35e15, "fp8": 2.7e15},
        "memory_bandwidth": 8e12,
    }
)
B200_NODE = Cluster(  # NVLink 5: 900 GB/s per direction, 80% of it as bus bandwidth; 400 Gb/s between nodes
    gpus_per_node=8, within=Link(bandwidth=720e9, latency=5e-6), between=Link(bandwidth=40e9, latency=15e-6)
)


@pytest.mark.slow
def test_qwen3_30b_on_eight_b200_prefers_fsdp_without_expert_parallelism(tmp_path: Path) -> None:
    """Published (torchtitan, 8 x B200): FSDP 8 without EP 19.5k tokens/s per GPU, EP 4 x PP 2 17.5k. On
    paper with a B200-like profile the search must rank no expert parallelism first and EP 4 x PP 2 below
    it: every token's rows cross the all-to-all twice each way per layer, and the busiest rank computes
    `max_load` times the mean's expert rows, while FSDP's gathers hide behind compute."""
    raw = recipe(WhatIf("Qwen/Qwen3-30B-A3B", mode="pretrain", world_size=8))
    path = tmp_path / "qwen3.yaml"
    path.write_text(yaml.safe_dump(raw))
    overrides = [
        "batch.global_size=64",
        "strategies.optimizer_states=fp32",
        "strategies.sharding=zero3",
        "strategies.checkpointing=full",  # torchtitan's; the ranking is about the mesh
        "strategies.loss=standard",
        "strategies.mesh.pp=auto",
        "strategies.mesh.ep=auto",
    ]
    loaded = CausalLMRecipe.load(path, overrides)
    spec = CausalLMTrainer(loaded).model_spec()
    probe = ModelProbe(spec)
    gpu = load_gpu("h200-141gb")  # B200's memory class: the search is about speed here, not fit
    result = search_meshes(
        loaded,
        lambda cp: probe,
        what_if_target(8, gpu, 180 * 10**9, None),
        B200_NODE,
        torch.device("cuda", 0),
        tensor_parallel_problems=spec.tensor_parallel_problems,
        pipeline=spec.pipeline,
        cost=CostModel(B200),
    )
    chosen = result.chosen
    assert chosen is not None and chosen.mesh.ep == 1 and chosen.mesh.pp == 1, chosen.mesh.describe()
    by_mesh = {(row.mesh.pp, row.mesh.ep): row for row in best_per_mesh(result.ranked)}
    ep4_pp2 = by_mesh[(2, 4)]
    assert ep4_pp2.tokens_per_second < chosen.tokens_per_second
    print(
        f"B200-like: {chosen.mesh.describe()} {chosen.tokens_per_second:,.0f} tokens/s/GPU, "
        f"{ep4_pp2.mesh.describe()} {ep4_pp2.tokens_per_second:,.0f}"
    )


@pytest.mark.slow
def test_deepseek_v3_layers_on_512_h100_plan_an_ep_mesh(tmp_path: Path) -> None:
    """DeepSeek-V3's layers on 64 nodes of 8 H100 (torchtitan #1558: "a lot of OOMs with different parallelism
    settings"), FSDP over every rank with full recompute and AdamW: without expert parallelism a rank gathers
    a whole MoE layer (256 experts of 3 x 7168 x 2048, 22.5 GB in bf16, whatever the depth) and runs out; the
    search finds an ep that fits. Its config with 5 layers (its 3 dense, 2 MoE), traced whole in seconds: the
    61-layer model is traced whole too (two block structures: no clone), 2 minutes of CPU cold, so its
    planning time is a benchmark's (docs/BENCHMARKS.md, "MoE what-ifs"), not this test's."""
    config = json.loads((CARDS / "deepseek-ai--DeepSeek-V3" / "config.json").read_text(encoding="utf-8"))
    model = tmp_path / "deepseek-v3-5-layers"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}), encoding="utf-8")
    raw = recipe(WhatIf(str(model), mode="pretrain", world_size=512))
    path = tmp_path / "v3.yaml"
    path.write_text(yaml.safe_dump(raw))
    overrides = [
        "batch.global_size=1024",
        "strategies.checkpointing=full",
        "strategies.optimizer_states=fp32",
        "strategies.sharding=zero3",
        "strategies.loss=standard",
        "strategies.mesh.ep=auto",
    ]
    loaded = CausalLMRecipe.load(path, overrides)
    spec = CausalLMTrainer(loaded).model_spec()
    gpu = load_gpu("h100-80gb")
    result = search_meshes(
        loaded,
        lambda cp: ModelProbe(spec),
        what_if_target(512, gpu, None, None),
        gpu.cluster,
        torch.device("cuda", 0),
        tensor_parallel_problems=spec.tensor_parallel_problems,
        pipeline=spec.pipeline,
    )
    chosen = result.chosen
    assert chosen is not None and chosen.mesh.ep > 1 and chosen.mesh.dp_shard == 512
    assert all(row.mesh.ep > 1 for row in result.ranked)  # ep 1 gathers all 256 experts of a layer: no fit
    assert 256 % chosen.mesh.ep == 0
    print(f"DeepSeek-V3 layers on 512 H100: {chosen.mesh.describe()}, peak {chosen.peak / GiB:.2f} GiB")
