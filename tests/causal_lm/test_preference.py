"""Preference training (DPO, `memtrain.causal_lm.preference`) on a tiny llama in fp32.

Before it there was no preference training: `data.kind: preference` and the `preference:` section were
unknown keys, so every test here failed on the recipe. What each one pins down beyond that is in its
docstring.
"""

from __future__ import annotations

import copy
import json
import math
import random
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from memtrain.causal_lm.preference import PreferenceTrainer, logps_of, read_pairs
from memtrain.causal_lm.recipe import CausalLMRecipe
from memtrain.causal_lm.tokenizer import load_tokenizer
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.errors import RecipeError
from memtrain.planner.model_probe import ModelProbe

from helpers import REPO, TINY_LLAMA, tiny_recipe, tiny_recipe_dict

SEQ_LEN = 16


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 string pairs whose rows fill `SEQ_LEN` (a short prompt, long completions cut there): the chosen
    completion repeats the prompt in capitals, the rejected one reversed."""
    rng = random.Random(0)
    rows = []
    for _ in range(48):
        prompt = "".join(rng.choice("abcdef") for _ in range(4))
        rows.append({"prompt": prompt, "chosen": prompt.upper() * 8, "rejected": prompt[::-1] * 8})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_recipe(tmp_path: Path, pairs: Path, **sections: dict[str, Any]) -> CausalLMRecipe:
    base: dict[str, dict[str, Any]] = {
        "model": {"config": {**TINY_LLAMA, "vocab_size": 260}},  # the byte tokenizer's ids
        "data": {
            "source": "jsonl",
            "path": str(pairs),
            "kind": "preference",
            "tokenizer": "byte",
            "seq_len": SEQ_LEN,
            "packing": False,
            "eval_fraction": 0.0,
        },
        "batch": {"global_size": 8, "micro_size": 4},
        "train": {"steps": 6, "lr": 1e-2, "warmup_steps": 0, "eval_every": 0},
        "preference": {"beta": 0.5},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return tiny_recipe(tmp_path, **base)


def written_out_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its labelled tokens: log-softmax over the vocabulary, each target's
    entry picked by indexing, the unlabelled positions zeroed, summed over the row."""
    logps = torch.log_softmax(model(input_ids=ids).logits, dim=-1)
    labelled = labels != -100
    rows, positions = torch.meshgrid(torch.arange(ids.shape[0]), torch.arange(ids.shape[1]), indexing="ij")
    picked = logps[rows, positions, torch.where(labelled, labels, 0)]
    return torch.where(labelled, picked, torch.zeros_like(picked)).sum(dim=1)


def written_out_dpo(
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    beta: float,
    smoothing: float,
) -> torch.Tensor:
    """The mean over pairs of -(1-s) logsigmoid(beta m) - s logsigmoid(-beta m), m the difference of the
    policy's and the reference's chosen-minus-rejected log-ratio sums. Chosen and rejected rows go through
    one forward (as TRL's), so float32 rounding in the model's backward is the same as the trainer's."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    n = batch["chosen_input_ids"].shape[0]
    policy_logps = written_out_logps(policy, ids, labels)
    with torch.no_grad():
        reference_logps = written_out_logps(reference, ids, labels)
    pc, pr, rc, rr = policy_logps[:n], policy_logps[n:], reference_logps[:n], reference_logps[n:]
    margin = beta * ((pc - pr) - (rc - rr))
    return (-(1 - smoothing) * F.logsigmoid(margin) - smoothing * F.logsigmoid(-margin)).mean()


def test_loss_and_gradients_equal_a_written_out_dpo(tmp_path: Path, pairs_file: Path) -> None:
    """The trainer's loss (a sum over pairs, normalised by the pair count) and its gradients equal the DPO
    loss written out here within 1e-6, in fp32 and in float64; the reference is the initial policy (a copy
    taken before the policy moves), not the policy."""
    recipe = dpo_recipe(tmp_path, pairs_file, preference={"reference": "copy", "label_smoothing": 0.1})
    trainer = PreferenceTrainer(recipe)
    assert isinstance(trainer, PreferenceTrainer)
    trainer.setup()
    policy, reference = trainer.model, trainer._reference_model
    assert policy is not None and reference is not None
    initial = copy.deepcopy(policy)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    batch = trainer.split_batch(trainer.step_batch(0), 8)[0]
    for dtype in (torch.float32, torch.float64):
        for model in (policy, reference, initial):
            model.to(dtype)
        policy.zero_grad(set_to_none=True)
        loss_sum, pairs = trainer.loss(policy, batch)
        assert int(pairs) == 8 == trainer.count_tokens(batch)
        (loss_sum / pairs).backward()
        got = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad(set_to_none=True)
        expected = written_out_dpo(policy, initial, batch, beta=0.5, smoothing=0.1)
        expected.backward()
        assert abs(float(loss_sum.detach() / pairs) - float(expected.detach())) <= 1e-6
        assert abs(float(expected.detach()) - math.log(2)) > 1e-3, "the perturbed policy is not its reference"
        assert got.keys() == {name for name, p in policy.named_parameters()}
        for name, parameter in policy.named_parameters():
            torch.testing.assert_close(got[name], parameter.grad, atol=1e-6, rtol=0, msg=f"{dtype} {name}")


def test_matches_trl_dpo_loss() -> None:
    """TRL's sigmoid DPO loss (cDPO's label smoothing) on the same log-probabilities, where a trl with the
    standalone `DPOTrainer.dpo_loss` imports (not a dependency). Checked on 2026-12-02 with trl 0.27.2 (its
    `is_*_available` checks patched for transformers 5, whose `_is_package_available` returns a tuple):
    equal to the last bit. trl 1.x folds the loss into `_compute_loss`, which needs a whole model's outputs."""
    trl = pytest.importorskip("trl", reason="trl is not installed; memtrain does not depend on it")
    try:
        dpo_loss = trl.DPOTrainer.dpo_loss
    except (AttributeError, ImportError, RuntimeError) as exc:
        pytest.skip(f"trl {trl.__version__} has no standalone DPOTrainer.dpo_loss here ({exc!r:.200})")
    from memtrain.causal_lm.preference import dpo_losses

    generator = torch.Generator().manual_seed(0)
    logps = [-torch.rand(6, generator=generator) * 20 for _ in range(4)]
    ours = dpo_losses((logps[0], logps[1]), (logps[2], logps[3]), beta=0.3, label_smoothing=0.1)
    settings = types.SimpleNamespace(
        beta=0.3,
        label_smoothing=0.1,
        loss_type="sigmoid",
        f_divergence_type="reverse_kl",
        use_weighting=False,
        reference_free=False,
        accelerator=types.SimpleNamespace(device=torch.device("cpu")),
    )
    theirs = dpo_loss(settings, *logps, loss_type="sigmoid")[0]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def test_reference_copy_bytes_predicted_and_measured(tmp_path: Path, pairs_file: Path) -> None:
    """The copy's weights (every parameter in the compute dtype: fp32 here, bf16 under bf16-mixed as the 8B
    what-if in tests/pretrained shows) are in the planner's predicted weights and in the tracker's measured
    ones, to the byte, and the predicted peak is within 3% of the measured one. Without
    `ModelSpec.frozen_bytes` and `MemoryTracker.count_as_weights` neither would count them."""
    from memtrain.memory.headroom import Target, budget_from
    from memtrain.planner.search import search

    recipe = dpo_recipe(
        tmp_path,
        pairs_file,
        preference={"reference": "copy"},
        strategies={"checkpointing": "none", "optimizer_states": "fp32"},
        memory={"track": True},
        train={"steps": 2},
    )
    trainer = PreferenceTrainer(recipe)
    target = Target("cpu", 1, budget_from(2**50, 2**50, 0, 0.0, "test"), bf16=True, fp8=False)
    chosen = search(recipe, ModelProbe(trainer.model_spec()), target, torch.device("cpu")).chosen
    assert chosen is not None and chosen.plan.micro_batch_size == 4
    trainer.fit()
    assert trainer.model is not None
    numel = sum(p.numel() for p in trainer.model.parameters())
    copy_bytes = 4 * numel
    measured = trainer.monitor.memory_reports[-1]
    assert chosen.prediction.at_peak.weights == measured.at_peak["weights"] == 4 * numel + copy_bytes
    assert abs(chosen.prediction.peak - measured.peak_bytes) < 0.03 * measured.peak_bytes


def test_full_dpo_trains_and_resumes_exactly(tmp_path: Path, pairs_file: Path) -> None:
    """Full DPO with the default reference (precomputed before step 1): step 1's loss is log 2 (the
    policy is its reference), the loss falls, and a resume from step 3 repeats steps 4-6 bit for bit (the
    reference log-probabilities come again from the initial weights, not the checkpoint's)."""
    recipe = dpo_recipe(tmp_path, pairs_file, checkpoint={"every": 3})
    first = PreferenceTrainer(recipe)
    assert first.reference == "precomputed"
    whole = first.fit()
    assert abs(whole.losses[0] - math.log(2)) < 1e-6
    assert whole.losses[-1] < 0.5 * whole.losses[0], whole.losses
    again = PreferenceTrainer(recipe).fit(resume=True)
    assert again.losses == whole.losses[3:]


def test_lora_dpo_trains_against_the_adapter_free_base(tmp_path: Path, pairs_file: Path) -> None:
    """LoRA DPO: the loss falls, and the reference log-probabilities after training are still the base
    model's (the adapters are off for the reference forward), while the policy's have moved."""
    recipe = dpo_recipe(
        tmp_path, pairs_file, adapters={"kind": "lora", "r": 4}, train={"lr": 3e-2, "steps": 4}
    )
    trainer = PreferenceTrainer(recipe)
    assert isinstance(trainer, PreferenceTrainer) and trainer.reference == "adapter_free"
    trainer.setup()
    assert trainer.model is not None
    batch = trainer.step_batch(0)
    with torch.no_grad():
        before = logps_of(trainer.model, batch)
    result = trainer.fit()
    assert result.losses[-1] < 0.8 * result.losses[0], result.losses
    with torch.no_grad():
        reference = trainer._reference_logps_of(trainer.model, batch)
        after = logps_of(trainer.model, batch)
    for side in range(2):
        torch.testing.assert_close(reference[side], before[side], atol=1e-5, rtol=0)
    assert not torch.allclose(after[0], before[0], atol=1e-3)


def test_chat_pairs_label_the_completion_and_micro_batches_keep_pairs(tmp_path: Path) -> None:
    """Messages pairs (TRL's conversational format) through the chat template: each side's labels are its
    completion's tokens only, and a step batch split into micro-batches keeps each pair's chosen and
    rejected rows together."""
    records = [
        {
            "prompt": [{"role": "user", "content": f"Say {word}"}],
            "chosen": [{"role": "assistant", "content": word}],
            "rejected": [{"role": "assistant", "content": word[::-1] + "!"}],
        }
        for word in ("one", "three", "seven", "eleven")
    ]
    path = tmp_path / "chat_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = str(REPO / "data/tiny-sft-tokenizer")
    raw = tiny_recipe_dict(
        tmp_path,
        model={"config": {**TINY_LLAMA, "vocab_size": 320}},
        data={
            "source": "jsonl",
            "path": str(path),
            "kind": "preference",
            "tokenizer": tokenizer,
            "seq_len": 48,
            "packing": False,
            "eval_fraction": 0.0,
        },
        batch={"global_size": 4, "micro_size": 2},
    )
    recipe = CausalLMRecipe.from_dict(raw)
    hf = load_tokenizer(tokenizer)
    splits = read_pairs(recipe.data, recipe.run.seed)
    completions = set()
    for pair in splits.train:
        for side in (pair.chosen, pair.rejected):
            labelled = side.labels[side.labels != -100].tolist()
            text = hf.hf.decode(labelled)
            assert text.endswith("<|im_end|>\n") and "Say" not in text and "assistant" not in text, text
            completions.add(text.removesuffix("<|im_end|>\n"))
    assert completions == {
        w for r in records for w in (r["chosen"][0]["content"], r["rejected"][0]["content"])
    }
    trainer = PreferenceTrainer(recipe)
    assert isinstance(trainer, PreferenceTrainer)
    trainer.plan = trainer.choose_plan().plan
    batch = trainer.step_batch(0)
    for micro in trainer.split_batch(batch, 2):
        for row, sample_id in enumerate(micro["sample_ids"].tolist()):
            pair = splits.train[sample_id]
            for side, sample in (("chosen", pair.chosen), ("rejected", pair.rejected)):
                width = micro[f"{side}_labels"].shape[1]  # trailing columns of padding only are trimmed
                assert micro[f"{side}_labels"][row, : len(sample)].tolist() == sample.labels[:width].tolist()
                assert bool((sample.labels[width:] == -100).all())


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"strategies": {"loss": "chunked"}}, "strategies.loss: chunked never holds the logits"),
        ({"preference": {"reference": "adapter_free"}}, "preference.reference: adapter_free needs adapters"),
        ({"data": {"kind": "chat"}, "preference": {"beta": 0.2}}, "preference: set data.kind: preference"),
    ],
)
def test_recipe_refuses_what_dpo_cannot_run(
    tmp_path: Path, pairs_file: Path, sections: dict[str, dict[str, Any]], message: str
) -> None:
    """One line naming the key, before anything is built."""
    with pytest.raises(RecipeError) as caught:
        dpo_recipe(tmp_path, pairs_file, **sections)
    assert len(caught.value.problems) == 1 and caught.value.problems[0].startswith(message), (
        caught.value.problems
    )


def test_a_saved_recipe_reads_back_without_problems(tmp_path: Path, pairs_file: Path) -> None:
    """A run's saved recipe holds every key, the defaults too: read back (as resume and export do) it has no
    problem, for preference data and for any other. The hole: the checks read which keys were given, so
    every saved SFT recipe was refused on resume and export for its default `preference.beta`, and every
    saved DPO recipe for its default `data.packing`."""
    for recipe in (dpo_recipe(tmp_path, pairs_file), tiny_recipe(tmp_path)):
        again = CausalLMRecipe.from_dict(recipe.to_dict())
        assert again.to_dict() == recipe.to_dict()


def test_memtrain_train_picks_the_dpo_trainer(
    tmp_path: Path, pairs_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`memtrain train` on a preference recipe trains with the DPO trainer (step 1's loss is log 2); the
    built-in trainer itself, given pairs from Python, refuses them in one line naming the key."""
    import yaml

    from memtrain.cli import main
    from memtrain.run.layout import RunLayout
    from memtrain.training.metrics import read_metrics

    recipe = dpo_recipe(tmp_path, pairs_file, train={"steps": 2})
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(recipe.to_dict()))
    assert main(["train", str(path)]) == 0, capsys.readouterr().err
    rows = read_metrics(RunLayout(recipe.output_path()).metrics_file)
    assert [row["step"] for row in rows] == [1, 2] and abs(rows[0]["loss"] - math.log(2)) < 1e-6
    with pytest.raises(RecipeError) as refused:
        CausalLMTrainer(recipe)
    assert refused.value.problems == [
        "data.kind: preference trains with memtrain.causal_lm.preference.PreferenceTrainer"
    ]
