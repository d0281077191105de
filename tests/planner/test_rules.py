"""validate ⊇ train's refusals: every rule of the planner's grid (planner/candidates.py, plan.py's
`pinned_plan`) that can leave no plan to run, whatever the memory, is reported by `memtrain validate` with
its keys, and `plan`'s / `train`'s "no plan fits" leads with it.

The hole: `memtrain validate` never built the grid, so a recipe whose choices exclude every candidate
(QLoRA with `sharding: [zero3]`, `in_backward` with an fp32 master copy, ...) validated ok, and `train`
stopped with "no plan fits the memory budget" and eight memory tips, the real cause on line 4. A pinned
quantised base with a sharding that shards weights passed `pinned_plan` too (FSDP2 refused it only
after the weights were loaded).

The rules (one case each, found in `build_grid` and `pinned_plan`): a quantised base with a sharding
that cannot hold it (zero1, DeepSpeed); a sharding that cannot train on this many ranks, or with this precision, or with
this gradient reduction (`Sharding.check_with`); a loss the sharding cannot run (`Loss.check_sharding`);
offload on a device where it saves nothing; paged 8-bit states with offload; `in_backward` where it is
not exact (`OptimizerStep.check_plan`); a kind whose every listed option this device cannot run, and a
pinned strategy that cannot run (`Strategy.check`).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import main
from memtrain.errors import PlanError, Unsupported
from memtrain.plan import adapters_of, quantization_of
from memtrain.planner.model_probe import ModelProbe
from memtrain.planner.rules import rule_problems
from memtrain.planner.search import search
from memtrain.strategies.registry import DeviceFacts

from helpers import tiny_recipe_dict
from planner_cases import cpu_target

NO_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
QLORA = {"model": {"quantization": "nf4"}, "adapters": {"kind": "lora", "r": 4}}

# name -> (ranks, recipe sections, the key=value the first line of plan's error names)
CPU_RULES: dict[str, tuple[int, dict[str, dict[str, Any]], str]] = {
    "quantised-base-sharding-that-cannot-hold-it": (
        1,
        {**QLORA, "strategies": {"sharding": ["zero1"]}},
        "strategies.sharding=zero1",
    ),
    "sharding-that-cannot-train-on-these-ranks": (
        2,
        {"strategies": {"sharding": ["none"]}},
        "strategies.sharding=none",
    ),
    "sharding-with-a-precision-it-cannot-run": (
        2,
        {"strategies": {"sharding": ["zero1"], "precision": "bf16-master"}},
        "strategies.sharding=zero1",
    ),
    "gradient-reduction-the-sharding-does-not-do": (
        2,
        {"strategies": {"sharding": ["ddp"], "gradient_reduction": "per_micro_step"}},
        "strategies.gradient_reduction",
    ),
    "offload-where-the-host-is-the-device": (
        2,
        {"strategies": {"sharding": ["zero3"], "sharding_offload": ["params"]}},
        "strategies.sharding_offload=params",
    ),
    "in_backward-with-a-master-copy": (
        1,
        {"strategies": {"optimizer_step": ["in_backward"], "precision": ["bf16-master"]}},
        "strategies.optimizer_step=in_backward",
    ),
    "every-listed-option-refused-by-the-device": (
        1,
        {"strategies": {"precision": ["fp8"]}},
        "strategies.precision",
    ),
    "pinned-quantised-base-with-zero1": (
        1,
        {
            **QLORA,
            "batch": {"micro_size": 8},
            "strategies": {"sharding": "zero1", "sharding_offload": "none"},
        },
        "model.quantization",
    ),
}
DEEPSPEED_RULES = {
    "loss-the-sharding-cannot-run": (
        2,
        {"strategies": {"sharding": ["zero3"], "sharding_backend": "deepspeed", "loss": ["chunked"]}},
        "strategies.loss=chunked",
    ),
}


def _raw(tmp: Path, sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tiny recipe with the planner open (micro-batch auto) and `sections` over it."""
    base = {"batch": {"micro_size": "auto"}}
    merged = {name: {**base.get(name, {}), **sections.get(name, {})} for name in {*base, *sections}}
    return tiny_recipe_dict(tmp, **merged)


def _write(tmp: Path, raw: dict[str, Any]) -> str:
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return str(path)


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.split("error: ", 1)[1]


@pytest.mark.parametrize(
    "name", [*CPU_RULES, *(pytest.param(n, marks=NO_DEEPSPEED) for n in DEEPSPEED_RULES)]
)
def test_validate_reports_each_rule_and_plan_leads_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    ranks, sections, key = {**CPU_RULES, **DEEPSPEED_RULES}[name]
    recipe = _write(tmp_path, _raw(tmp_path, sections))
    assert main(["plan", recipe, "--world-size", str(ranks)]) == 2
    first = _error(capsys).splitlines()[0]
    assert key in first, first
    assert "memory budget" not in first, "memory is not the cause"
    monkeypatch.setenv("WORLD_SIZE", str(ranks))  # validate judges the ranks train would start with
    assert main(["validate", recipe]) == 2
    lines = [line[4:] for line in _error(capsys).splitlines() if line.startswith("  - ")]
    assert any(line.startswith(key) or f" {key}" in line for line in lines), lines
    if ranks == 1:  # train (in this process: one rank) stops with the same first line, having written nothing
        monkeypatch.delenv("WORLD_SIZE")
        assert main(["train", recipe]) == 2
        assert key in _error(capsys).splitlines()[0]
        assert not (tmp_path / "run").exists()


def test_paged_states_with_offload_on_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The one rule only a GPU target meets (paged 8-bit states need CUDA; offload is a GPU's): checked
    for the what-if GPU's facts, as `plan --gpu` judges them."""
    sections = {
        "strategies": {
            "optimizer_states": ["paged-8bit"],
            "sharding": ["zero3"],
            "sharding_offload": ["params"],
        }
    }
    raw = _raw(tmp_path, sections)
    assert main(["plan", _write(tmp_path, raw), "--gpu", "h100-80gb", "--world-size", "2"]) == 2
    assert (
        "strategies.optimizer_states=paged-8bit with sharding_offload=params"
        in _error(capsys).splitlines()[0]
    )
    facts = DeviceFacts("cuda", 2, bf16=True, fp8=True, what_if=True)
    found = rule_problems(CausalLMRecipe.from_dict(raw), facts)
    assert any(line.startswith("strategies.optimizer_states=paged-8bit") for line in found), found


def test_a_recipe_some_plan_can_run_has_no_rule_problem(tmp_path: Path) -> None:
    """Exclusions that leave a candidate are the planner's business, not a problem (fp8 and zero3 listed
    beside what can run)."""
    raw = _raw(
        tmp_path, {**QLORA, "strategies": {"sharding": ["zero3", "none"], "precision": ["fp8", "fp32"]}}
    )
    assert rule_problems(CausalLMRecipe.from_dict(raw)) == []


CHOICES: dict[str, list[Any]] = {  # what the sample draws from (recipe key -> values)
    "strategies.sharding": ["auto", ["none"], ["ddp"], ["zero2"], ["zero3"], ["ddp", "zero3"]],
    "strategies.optimizer_step": ["standard", ["in_backward"], "auto"],
    "strategies.sharding_offload": ["none", "auto", ["params"]],
    "strategies.loss": ["standard", ["chunked"]],
    "strategies.precision": ["fp32", ["fp32", "bf16-master"], "bf16-master"],
    "strategies.gradient_reduction": ["auto", "per_step", "per_micro_step"],
    "train.grad_clip": [1.0, None],
    "batch.micro_size": ["auto", 4],
    "model.quantization": ["none", "nf4"],
}


def _sample(rng: random.Random, tmp: Path) -> tuple[int, CausalLMRecipe]:
    sections: dict[str, dict[str, Any]] = {}
    for key, values in CHOICES.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = rng.choice(values)
    if sections["model"]["quantization"] != "none":
        sections["adapters"] = {"kind": "lora", "r": 4}
    return rng.choice([1, 2]), CausalLMRecipe.from_dict(_raw(tmp, sections))


def test_whatever_plan_refuses_for_a_rule_validate_refuses(tmp_path: Path) -> None:
    """A seeded sample of recipes over the rules' keys, planned on a 1-byte budget (no candidate fits, so
    none is traced: the search judges each candidate's model states alone): every recipe the planner
    refuses for another reason than memory (a strategy that cannot run, or "no plan fits" because the
    rules excluded every candidate) has rule problems in validate, every other one none; the sample
    holds refusals of several rules and recipes refused for memory alone."""
    rng = random.Random(27)
    probes: dict[str, ModelProbe] = {}
    refused, memory_only = set(), 0
    for _ in range(40):
        ranks, recipe = _sample(rng, tmp_path)
        quantization = quantization_of(recipe)
        if quantization.name not in probes:
            spec = CausalLMTrainer(recipe).model_spec()
            probes[quantization.name] = ModelProbe(
                spec, adapters=adapters_of(recipe), quantization=quantization
            )
        problems = rule_problems(recipe, DeviceFacts("cpu", ranks, bf16=True, fp8=False))
        try:
            search(recipe, probes[quantization.name], cpu_target(1, ranks), torch.device("cpu"))
        except Unsupported as exc:
            assert problems == [str(exc)], "a strategy that cannot run: the same line in validate"
            refused.add(str(exc).split(":", 1)[0])
            continue
        except PlanError as exc:
            if str(exc).startswith("no plan fits the memory budget"):
                memory_only += 1
                assert problems == [], "validate refused a recipe only memory stops"
                continue
            first = str(exc).splitlines()[0]
            assert problems, f"plan refused, validate did not: {first}"
            assert all(line.split(": ", 1)[0] in first for line in problems[1:]), (first, problems)
            refused.update(line.split("=", 1)[0] for line in problems[1:])
            continue
        raise AssertionError("a 1-byte budget fits no plan")
    assert memory_only >= 5 and len(refused) >= 3, (memory_only, refused)
