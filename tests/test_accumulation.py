"""Token-exact gradient accumulation on variable-length padded batches.

The Trainer divides each micro-batch's *summed* loss by the token count of the whole step batch. The
gradient then equals the gradient of the mean over all tokens, whatever the micro-batching. The common
mistake — averaging each micro-batch's loss and dividing by the number of micro-steps — weights the
tokens of short micro-batches more; `test_dividing_by_micro_steps_is_detected` recomputes the gradient
that way on the same data and shows it differs by far more than the 1e-6 tolerance used here, so the
equivalence test would fail if the Trainer normalised that way.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memtrain.causal_lm.trainer import CausalLMTrainer

from helpers import tiny_recipe

TOL = 1e-6


def _grads_and_params(
    tmp_path: Path, micro: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    # lr 1e-3: AdamW's first update is lr * g / (|g| + eps), so for gradients near eps (1e-8) a 1e-9
    # relative rounding difference in g moves the parameter by up to ~lr * 1e-4; at 1e-3 that stays
    # well inside the tolerance while any normalisation error (see the negative control) does not.
    recipe = tiny_recipe(
        tmp_path / f"m{micro}", batch={"global_size": 8, "micro_size": micro}, train={"lr": 1e-3}
    )
    trainer = CausalLMTrainer(recipe)
    trainer.setup()
    assert trainer.plan.accumulation_steps == 8 // micro
    totals = trainer.accumulate_gradients(0)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    row = trainer.train_step(0)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert row["micro_batches"] == 8 // micro
    return grads, params, float(totals.loss_sum) / totals.global_tokens


def test_batch_is_variable_length_and_padded(tmp_path: Path) -> None:
    trainer = CausalLMTrainer(tiny_recipe(tmp_path))
    labels = trainer.step_batch(0)["labels"]
    real_per_row = (labels != -100).sum(dim=1)
    assert len(set(real_per_row.tolist())) > 2, "the test data must have rows of different lengths"
    assert (labels == -100).any(), "the test data must contain padding"


@pytest.mark.parametrize("micro", [4, 1])
def test_accumulation_matches_single_micro_batch(tmp_path: Path, micro: int) -> None:
    ref_grads, ref_params, ref_loss = _grads_and_params(tmp_path, 8)
    grads, params, loss = _grads_and_params(tmp_path, micro)
    assert loss == pytest.approx(ref_loss, abs=TOL)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=TOL, rtol=0, msg=f"gradient of {name}")
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            params[name], ref, atol=TOL, rtol=0, msg=f"parameter {name} after one step"
        )


def test_dividing_by_micro_steps_is_detected(tmp_path: Path) -> None:
    """Negative control: per-micro-batch mean / number of micro-steps gives a visibly different gradient."""
    ref_grads, _, _ = _grads_and_params(tmp_path, 8)
    trainer = CausalLMTrainer(tiny_recipe(tmp_path / "naive", batch={"global_size": 8, "micro_size": 1}))
    trainer.setup()
    micro_batches = trainer.split_batch(trainer.step_batch(0), 1)
    for mb in micro_batches:
        logits = trainer.model(input_ids=mb["input_ids"]).logits
        mean = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1), ignore_index=-100
        )
        (mean / len(micro_batches)).backward()
    worst = max((p.grad - ref_grads[n]).abs().max().item() for n, p in trainer.model.named_parameters())
    assert worst > 100 * TOL


def test_token_budget_micro_batches_are_exact_and_within_budget(tmp_path: Path) -> None:
    """Packing by a token budget gives the same gradient as one micro-batch of the whole batch."""
    ref_grads, _, _ = _grads_and_params(tmp_path, 8)
    recipe = tiny_recipe(
        tmp_path / "tokens",
        batch={"global_size": 8, "micro_size": "auto", "micro_tokens": 40},
        train={"lr": 1e-3},
    )
    trainer = CausalLMTrainer(recipe)
    trainer.setup()
    micro = trainer.split_batch(trainer.step_batch(0), trainer.plan.micro_batch_size)
    assert len(micro) > 1
    for mb in micro:
        assert mb["input_ids"].numel() <= 40 or mb["input_ids"].shape[0] == 1
    ids = sorted(i for mb in micro for i in mb["sample_ids"].tolist())
    assert ids == sorted(trainer.step_batch(0)["sample_ids"].tolist())
    trainer.accumulate_gradients(0)
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=TOL, rtol=0, msg=name)


def test_pack_by_tokens_by_hand() -> None:
    from memtrain.strategies.micro_batching import pack_by_tokens

    assert pack_by_tokens([5, 10, 3, 10, 2], max_tokens=20) == [[1, 3], [0, 2, 4]]
    assert pack_by_tokens([30, 4], max_tokens=20) == [[0], [1]]  # a row over budget goes alone
