"""A 2-block llama (transformers) against counts made independently of the tracker.

Weights, gradients and optimizer states: unique storages of the parameters, their `.grad` and the tensors in
`optimizer.state`, summed at phase boundaries. Activations: what autograd packs through saved_tensors_hooks
(unique storages, still alive, not parameters/buffers/inputs) plus the loss the caller holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from memtrain.memory import MemoryTracker


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _tiny_llama(tie: bool = False) -> PreTrainedModel:
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_components_match_independent_counts() -> None:
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (2, 32))
    params = list(model.parameters())
    not_activations = {id(t.untyped_storage()) for t in [*params, *model.buffers(), ids]}

    saved: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[id(st)] = (weakref.ref(st), st.nbytes())
        return t

    tracker = MemoryTracker(model, optimizer)
    with tracker:
        for step in (1, 2):
            tracker.begin_step(step)
            saved.clear()
            with tracker.phase("forward"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            at_forward_end = tracker.snapshot()
            alive_saved = {
                k: n for k, (ref, n) in saved.items() if ref() is not None and k not in not_activations
            }
            alive_saved[id(loss.untyped_storage())] = loss.untyped_storage().nbytes()
            assert at_forward_end["activations"] == sum(alive_saved.values()) > 0

            with tracker.phase("backward"):
                loss.backward()
            del loss
            at_backward_end = tracker.snapshot()
            assert at_backward_end["weights"] == _unique_bytes(params)
            assert at_backward_end["gradients"] == _unique_bytes(p.grad for p in params if p.grad is not None)
            assert at_backward_end["activations"] == 0

            with tracker.phase("optimizer"):
                optimizer.step()
            at_optimizer_end = tracker.snapshot()
            states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            assert at_optimizer_end["optimizer_states"] == _unique_bytes(states)
            optimizer.zero_grad()
            report = tracker.end_step()
            assert sum(report.at_peak.values()) == report.peak_bytes
            assert report.peak_bytes >= max(sum(at_forward_end.values()), sum(at_backward_end.values()))
            # a module is named exactly when the peak falls inside the model's forward or backward
            assert (report.peak_module != "") == (report.peak_phase in ("forward", "backward"))
    weights = _unique_bytes(params)
    assert weights == 4 * sum(p.numel() for p in params)  # untied: every parameter has its own storage


def test_tied_llama_weights_count_once() -> None:
    model = _tiny_llama(tie=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with MemoryTracker(model) as tracker:
        assert tracker.snapshot()["weights"] == 4 * sum(p.numel() for p in model.parameters())
        assert tracker.snapshot()["weights"] == _unique_bytes(model.parameters())
