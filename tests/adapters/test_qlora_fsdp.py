"""QLoRA under FSDP2 on two gloo ranks: the 4-bit base (bitsandbytes' packed uint8 storage) sharded by zero3,
LoRA adapters training on it. Each rank holds half the quantised base, the plan's per-rank stored weights are
the bytes the ranks hold (to the byte), its peak (the arithmetic's, and the rank trace's) the tracker's, and
the training is one process's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.distributed import DistEnv
from memtrain.errors import Unsupported
from memtrain.mesh import MeshShape
from memtrain.plan import Plan, mesh_of, pinned_plan
from memtrain.planner.rank_trace import trace_rank
from memtrain.training.metrics import read_metrics

from helpers import REPO, TINY_LLAMA, assert_trained_alike, initial_weights, run_two_ranks, tiny_recipe_dict

pytest.importorskip("bitsandbytes")

MODEL = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 256}


def _raw(tmp_path: Path, sharding: str, pretrained: Path | None = None, **strategies: Any) -> dict[str, Any]:
    raw = tiny_recipe_dict(
        tmp_path,
        model={"config": MODEL, "quantization": "nf4"},
        adapters={"kind": "lora", "r": 4, "alpha": 8},
        memory={"track": True},
        batch={"global_size": 8, "micro_size": "auto"},
        data={"seq_len": 32, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}},
        strategies={"optimizer_states": "fp32", "sharding": sharding, **strategies},
        train={"steps": 3, "lr": 1e-2},
    )
    if pretrained is not None:
        raw["model"] = {"pretrained": str(pretrained), "quantization": "nf4"}
    return raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The zero3 run on two ranks, and the same job (seed, data, model) in one process, replicated. The base
    is a saved model (`model.pretrained`): under FSDP2 each rank reads it whole on the host, quantises it and
    keeps its shards (`apply_strategies`), the path a real base takes."""
    tmp = tmp_path_factory.mktemp("qlora_fsdp")
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL)).save_pretrained(tmp / "base")
    spec = tmp / "zero3.json"
    raw = _raw(tmp / "zero3", "zero3", tmp / "base")
    spec.write_text(json.dumps(raw))
    run_two_ranks(str(REPO / "tests/adapters/qlora_fsdp_job.py"), str(spec), str(tmp / "out.json"))
    one = CausalLMTrainer(CausalLMRecipe.from_dict(_raw(tmp / "one", "none", tmp / "base")))
    fitted = one.fit()
    assert one.model is not None
    packed = sum(p.untyped_storage().nbytes() for p in one.model.parameters() if p.dtype == torch.uint8)
    trained = {n: p.detach().float().clone() for n, p in one.model.named_parameters() if p.requires_grad}
    initial = initial_weights(CausalLMRecipe.from_dict(_raw(tmp / "initial", "none", tmp / "base")))
    zero3 = json.loads((tmp / "out.json").read_text())
    recipe = CausalLMRecipe.from_dict(raw)
    plan = Plan.from_dict(zero3["plan"]).replace(mesh=mesh_of(recipe, 2))
    job = CausalLMTrainer(recipe).model_spec()
    zero3["traced"] = [trace_rank(job, plan, rank).prediction(job.host_bytes()).peak for rank in (0, 1)]
    return {
        "zero3": zero3,
        "one": {"losses": fitted.losses, "packed": packed, "adapters": trained, "initial": initial},
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_holds_half_the_quantised_base(runs: dict[str, Any]) -> None:
    """The packed 4-bit storage one process keeps whole is split in two (every weight's row count is even
    here, so FSDP2 pads nothing), and the plan's stored weights are each rank's bytes: its parameter shards
    (LoRA, embeddings, norms and head sharded too) with the quantisation constants it keeps whole."""
    ranks = runs["zero3"]["ranks"]
    assert all(r["sharding"] == "zero3" for r in ranks)
    assert [r["packed"] for r in ranks] == [runs["one"]["packed"] // 2] * 2
    assert all(r["predicted_stored"] == r["stored"] for r in ranks), ranks


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_peak_matches_each_ranks_tracker(runs: dict[str, Any]) -> None:
    """The arithmetic's peak (what `memtrain plan` predicts for a flat mesh) never under each rank's tracker
    by more than 0.5% and over it by at most 5%: it adds the gathered root and two gathered blocks to the
    states as if alive at once (`StateBytes.footprint`, an upper bound by design). Measured +3.8% (rank 0
    and 1 alike); the rank trace, which follows FSDP2's frees, is held to 3% below."""
    for rank in runs["zero3"]["ranks"]:
        error = (rank["predicted_peak"] - rank["measured_peak"]) / rank["measured_peak"]
        assert -0.005 <= error <= 0.05, rank


@pytest.mark.slow
@pytest.mark.distributed
def test_the_rank_trace_predicts_each_ranks_peak(runs: dict[str, Any]) -> None:
    """The run's plan traced as rank 0 and rank 1 of the fake process group, its linears the packed stand-in
    (`FourBit.packed_stand_in`: bitsandbytes cannot quantise fake tensors), against each rank's tracker:
    within issue 25's acceptance for the rank trace (tests/parallel/test_rank_trace.py: 3% over, 0.5%
    under)."""
    zero3 = runs["zero3"]
    for traced, rank in zip(zero3["traced"], zero3["ranks"], strict=True):
        error = (traced - rank["measured_peak"]) / rank["measured_peak"]
        assert -0.005 <= error <= 0.03, (traced, rank)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_zero3_trains_like_one_process(runs: dict[str, Any]) -> None:
    """The same quantised weights (each rank quantises the whole base, then keeps its shard; the gathered
    copy is the packed bytes, so the forward is bit for bit the replicated layer's) and the same batches: the
    losses differ only by the order the ranks' sums take, 1e-5 relative as for LoRA under DDP
    (test_lora.py), and the adapters end within `REDUCTION_ORDER` of the distance they moved."""
    zero3, one = runs["zero3"], runs["one"]
    assert zero3["losses"] == pytest.approx(one["losses"], rel=1e-5)
    got = {n: torch.tensor(v) for n, v in zero3["adapters"].items()}
    initial = {n: v for n, v in one["initial"].items() if n in one["adapters"]}
    assert_trained_alike(got, one["adapters"], initial)


@pytest.mark.parametrize(
    ("quantization", "strategies", "key"),
    [
        ("nf4", {"sharding": "zero3", "sharding_backend": "deepspeed"}, "DeepSpeed"),
        ("nf4", {"sharding": "zero1"}, "ZeroRedundancyOptimizer"),
        ("int8", {"sharding": "zero3"}, "Int8Params.SCB"),
    ],
)
def test_shardings_that_cannot_hold_a_quantised_base_refuse_it(
    tmp_path: Path, quantization: str, strategies: dict[str, Any], key: str
) -> None:
    raw = _raw(tmp_path, "none")
    raw["model"]["quantization"] = quantization
    raw["strategies"].update(strategies)
    raw["batch"]["micro_size"] = 8
    trainer = CausalLMTrainer(CausalLMRecipe.from_dict(raw))
    with pytest.raises(
        Unsupported, match=f"model.quantization: {quantization} with strategies.sharding .*{key}"
    ):
        trainer.choose_plan()


def test_tensor_parallelism_refuses_a_quantised_base(tmp_path: Path) -> None:
    raw = _raw(tmp_path, "none")
    raw["strategies"]["mesh"] = {"tp": 2}
    with pytest.raises(Unsupported, match="model.quantization: nf4 with strategies.mesh.tp=2"):
        pinned_plan(CausalLMRecipe.from_dict({**raw, "batch": {**raw["batch"], "micro_size": 8}}), _env(2))


def _env(ranks: int) -> DistEnv:
    return DistEnv(0, ranks, 0, torch.device("cpu"), mesh=MeshShape(tp=ranks))


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_qlora_resumes_from_its_sharded_checkpoint(tmp_path: Path) -> None:
    """A zero3 QLoRA run's DCP checkpoint (the packed base's shards with the adapters and their optimizer
    states) resumed on two ranks continues as the uninterrupted run: the same losses, bit for bit (the
    same ranks, batches and reductions)."""
    raw = _raw(tmp_path / "whole", "zero3")
    raw["batch"]["micro_size"] = 2
    raw["train"]["steps"] = 4
    raw["checkpoint"] = {"every": 2, "keep": 3, "at_end": True}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    run_two_ranks("-m", "memtrain", "train", str(recipe), "--no-progress")
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    shutil.rmtree(tmp_path / "split/run/checkpoints/step_00000004")
    raw["run"]["output_dir"] = str(tmp_path / "split/run")
    recipe.write_text(yaml.safe_dump(raw))
    run_two_ranks("-m", "memtrain", "train", str(recipe), "--resume", "--no-progress")
    losses = [
        [r["loss"] for r in read_metrics(tmp_path / d / "run/metrics.jsonl")] for d in ("whole", "split")
    ]
    assert len(losses[0]) == 4 and losses[1] == losses[0]
