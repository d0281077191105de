"""LoRA through peft, planned: only the adapters train and only they have gradients and optimizer states,
the planner predicts the tracker's peak, and resume and 2-rank DDP stay exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError
from memtrain.training.metrics import read_metrics

from helpers import (
    REPO,
    TINY_LLAMA,
    assert_trained_alike,
    initial_weights,
    subprocess_env,
    tiny_recipe,
    tiny_recipe_dict,
)

pytestmark = pytest.mark.usefixtures("shared_traces")  # tests/conftest.py: alike jobs planned again

MODEL = {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 256}
LORA = {"kind": "lora", "r": 4, "alpha": 8}
PLANS = {
    "fp32": {},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "bf16-mixed-frozen-fp32": {"precision": "bf16-mixed", "frozen_dtype": "fp32"},
    "full": {"checkpointing": "full"},
}


def _recipe(tmp_path: Path, **sections: dict[str, Any]):  # type: ignore[no-untyped-def]
    base: dict[str, dict[str, Any]] = {
        "model": {"config": MODEL},
        "adapters": LORA,
        "memory": {"track": True},
        "train": {"steps": 3},
        "data": {"seq_len": 32, "eval_fraction": 0.0, "synthetic": {"num_samples": 16, "min_len": 0}},
        "batch": {"global_size": 8, "micro_size": 4},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_recipe(tmp_path, **base)


def _adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".lora_" in n}


@pytest.mark.parametrize("plan", PLANS)
def test_predicted_peak_and_states_are_the_adapters(tmp_path: Path, plan: str) -> None:
    """Only the adapters train; the frozen base's weights are stored in bf16 under bf16-mixed (in fp32 with
    `frozen_dtype: fp32`, and under fp32), and the predicted weights are the tracker's to the byte (the
    hole: a frozen base was kept in fp32 under bf16-mixed, twice the bytes a frozen weight needs)."""
    trainer = CausalLMTrainer(_recipe(tmp_path, strategies={"optimizer_states": "fp32", **PLANS[plan]}))
    spec_result = _open_micro_prediction(tmp_path, plan)
    trainer.setup()
    assert trainer.model is not None and trainer.optimizer is not None
    adapters = _adapter_params(trainer.model)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable == set(adapters) and adapters, "only the adapters train"
    stepped = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in adapters.values()}, "only the adapters are in the optimizer"
    trainer.fit()
    measured = trainer.monitor.memory_reports[-1]
    predicted = spec_result.prediction
    assert abs(predicted.peak - measured.peak_bytes) / measured.peak_bytes < 0.02, (predicted.peak, measured)
    numel = sum(p.numel() for p in adapters.values())
    weights, gradients, states = spec_result.states.stored
    assert gradients == 4 * numel, "gradients of the adapters only"
    assert states == 8 * numel + 4 * len(adapters), "AdamW moments and steps of the adapters only"
    base = {n: p for n, p in trainer.model.named_parameters() if n not in adapters}
    frozen_dtype = torch.bfloat16 if plan == "bf16-mixed" else torch.float32
    assert {p.dtype for p in base.values()} == {frozen_dtype}
    assert {p.dtype for p in adapters.values()} == {torch.float32}, "the adapters train in fp32"
    assert weights == 4 * numel + frozen_dtype.itemsize * sum(p.numel() for p in base.values())
    assert measured.at_peak["weights"] == weights
    assert measured.at_peak["optimizer_states"] == states


def _open_micro_prediction(tmp_path: Path, plan: str) -> Any:
    """The planner's prediction of the pinned plan, as a search over every micro-batch size makes it."""
    from memtrain.memory.headroom import Target, budget_from
    from memtrain.plan import adapters_of
    from memtrain.planner.model_probe import ModelProbe
    from memtrain.planner.search import search

    recipe = _recipe(
        tmp_path / "plan",
        strategies={"optimizer_states": "fp32", **PLANS[plan]},
        batch={"micro_size": "auto"},
    )
    probe = ModelProbe(CausalLMTrainer(recipe).model_spec(), adapters=adapters_of(recipe))
    huge = 2**50
    result = search(
        recipe,
        probe,
        Target("cpu", 1, budget_from(huge, huge, 0, 0.0, "test"), True, False),
        torch.device("cpu"),
    )
    (match,) = [s for s in result.ranked if s.plan.micro_batch_size == 4]
    return match


def test_lora_saves_states_next_to_full_fine_tuning(tmp_path: Path) -> None:
    auto = {"micro_size": "auto"}
    full = CausalLMTrainer(_recipe(tmp_path / "full", adapters={"kind": "none"}, batch=auto))
    lora = CausalLMTrainer(_recipe(tmp_path / "lora", batch=auto))
    states = [t.choose_plan().chosen.states.stored for t in (full, lora)]  # type: ignore[union-attr]
    assert states[1][0] > states[0][0], "the adapters add weights"
    assert states[1][1] < states[0][1] / 10 and states[1][2] < states[0][2] / 10, (
        "and save gradients and states"
    )


def test_the_printed_plan_names_the_rank(tmp_path: Path) -> None:
    """The hole: a strategy printed the values that differ from their defaults, unnamed, so the adapters of
    rank 16 (the default) with dropout 0.05 printed as `lora(0.05)`, read as a rank."""
    from memtrain.plan import adapters_of
    from memtrain.planner import plan_here
    from memtrain.planner.explain import describe

    lora = {"kind": "lora", "r": 16, "alpha": 8, "dropout": 0.05}
    recipe = tiny_recipe(tmp_path, adapters=lora)
    result = plan_here(recipe, CausalLMTrainer(recipe).model_spec())
    assert result.plan.describe().startswith("lora(r=16, alpha=8, dropout=0.05), fp32")  # the progress line
    assert "more than lora(r=16, alpha=8, dropout=0.05))" in describe(result, "plan")
    targeted = {"kind": "lora", "r": 4, "target_modules": ["q_proj", "v_proj"]}
    assert adapters_of(tiny_recipe(tmp_path, adapters=targeted)).describe() == (
        "lora(r=4, alpha=32, targets=q_proj+v_proj)"  # no dropout: not named
    )


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    """A run resumed from its step-2 checkpoint ends with the same adapters and losses as the run that went
    through (the base stays frozen, the adapters and their optimizer states come back from the checkpoint)."""
    import shutil

    sections = {
        "train": {"steps": 4, "lr": 1e-2},
        "checkpoint": {"every": 2, "keep": 3, "at_end": True},
        "memory": {"track": False},
    }
    whole = CausalLMTrainer(_recipe(tmp_path / "whole", **sections))
    whole.fit()
    shutil.copytree(tmp_path / "whole", tmp_path / "split")
    shutil.rmtree(tmp_path / "split/run/checkpoints/step_00000004")
    resumed = CausalLMTrainer(_recipe(tmp_path / "split", **sections))
    resumed.fit(resume=True)
    assert whole.model is not None and resumed.model is not None
    for (name, a), b in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    losses = [r["loss"] for r in read_metrics(tmp_path / "split/run/metrics.jsonl")]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "whole/run/metrics.jsonl")]


def test_unknown_adapter_kind_and_target(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="adapters.kind: 'lroa' is not one of none, lora"):
        _recipe(tmp_path, adapters={"kind": "lroa"})
    trainer = CausalLMTrainer(_recipe(tmp_path, adapters={"target_modules": ["no_such_proj"]}))
    with pytest.raises(Exception, match="adapters.target_modules"):
        trainer.setup()


@pytest.mark.distributed
def test_two_rank_ddp_matches_one_process(tmp_path: Path) -> None:
    """Two ranks sum the same micro-batch gradients in another order than one process: (a+b)+(c+d), not
    ((a+b)+c)+d (the micro-batches' own gradients are the same: same kernels, one thread; the scale by 2
    and the average over 2 ranks are exact). Each gradient element then differs by ~2^-24 of the sum of its
    micro-batches' magnitudes, and AdamW's step lr * m/(sqrt(v) + eps) does not shrink with the gradient:
    an element whose micro-batches nearly cancel can step differently by up to lr. So single elements are
    not comparable (a fresh clone had 1 of 256 off by 1.3e-5, 1.3e-3 lr, against atol 1e-6), the model is:
    the adapters end within `REDUCTION_ORDER` (1e-2) of the distance they moved, 100x the worst of 200
    simulated machines (helpers.py says how it was measured); a missed all-reduce ends at ~1. The frozen
    base is bit-identical, and the losses (sums over every token) agree to 1e-5."""
    runs, raws = {}, {}
    for name, ranks, sharding in (("one", 1, "none"), ("ddp", 2, "ddp")):
        raw = tiny_recipe_dict(
            tmp_path / name,
            model={"config": MODEL},
            adapters=LORA,
            train={"steps": 3, "lr": 1e-2},
            strategies={"sharding": sharding},
            batch={"global_size": 8, "micro_size": 2},
            checkpoint={"at_end": True},
        )
        raws[name] = raw
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        launch = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
            if ranks > 1
            else [sys.executable]
        )
        done = subprocess.run(
            [*launch, "-m", "memtrain", "train", str(path), "--no-progress"],
            cwd=REPO,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = tmp_path / name / "run"
    losses = [[r["loss"] for r in read_metrics(runs[n] / "metrics.jsonl")] for n in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    states = [torch.load(runs[n] / "checkpoints/step_00000003/model.pt", weights_only=True) for n in runs]
    fresh = {**raws["one"], "run": {**raws["one"]["run"], "output_dir": str(tmp_path / "initial")}}
    initial = initial_weights(CausalLMRecipe.from_dict(fresh))  # seeded: the weights both runs started from
    assert_trained_alike(states[1], states[0], initial)
