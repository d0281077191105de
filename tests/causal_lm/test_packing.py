"""Packing: documents joined with EOS (one BOS, at the start), rows of seq_len, position ids restarting per
document; each document's loss in a packed batch equals its loss alone (sdpa and eager, split and whole
packing: whole, every document is compared), through the trainer's own `loss`; and `memtrain plan`
predicts a packed run's peak within 2% of `memtrain profile`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm.packing import Packer, document_sample, pack, position_ids, rows_of
from memtrain.causal_lm.recipe import CausalLMRecipe, DataConfig
from memtrain.causal_lm.sft import IGNORE_INDEX, Document
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import main

from helpers import REPO, TINY_LLAMA, tiny_recipe

EOS, BOS = 1, 2


def _docs(count: int, seed: int, bos: bool = False) -> list[Document]:
    """Documents of 3 to 14 random tokens (ids >= 3) ending with EOS; some with masked prompts."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for index in range(count):
        length = int(torch.randint(3, 15, (), generator=generator))
        tokens = [
            *([BOS] if bos else []),
            *torch.randint(3, 64, (length,), generator=generator).tolist(),
            EOS,
        ]
        labels = None
        if index % 3 == 1:  # a prompt/completion document: the first half is context
            half = len(tokens) // 2
            labels = [IGNORE_INDEX] * half + tokens[half:]
        docs.append(Document(tokens, labels))
    return docs


def test_rows_join_documents_with_eos_and_restart_positions() -> None:
    docs = [Document([BOS, 10, 11, EOS]), Document([BOS, 20, 21, 22, EOS]), Document([BOS, 30, EOS])]
    rows = pack(docs, seq_len=5, bos=[BOS])
    # One stream: BOS only at its start, each document ended by EOS; inputs [r*5, r*5+5), targets one later.
    assert [r.input_ids.tolist() for r in rows] == [[BOS, 10, 11, EOS, 20], [21, 22, EOS, 30]]
    assert [r.labels.tolist() for r in rows] == [[10, 11, EOS, -100, 21], [22, EOS, -100, EOS]]
    batch = data_lib.collate(rows, [0, 1])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert batch["labels"][1, -1] == IGNORE_INDEX  # the shorter last row is padded


def test_streamed_packer_gives_the_same_rows_as_pack() -> None:
    docs = _docs(40, seed=1, bos=True)
    packer = Packer(16, [BOS])
    streamed = [row for doc in docs for row in packer.add(doc)] + packer.flush()
    listed = pack(docs, 16, [BOS])
    assert len(streamed) == len(listed) > 10
    for a, b in zip(streamed, listed, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert a.starts is not None and b.starts is not None and torch.equal(a.starts, b.starts)
    assert sum(int((r.input_ids == BOS).sum()) for r in listed) == 1  # no stray BOS in the middle


def test_position_ids_restart_at_every_start_and_row() -> None:
    starts = torch.tensor(
        [[False, False, True, False, False, True], [True, False, False, False, True, False]]
    )
    assert position_ids(starts).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]


def _model(attention: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**TINY_LLAMA, "vocab_size": 64})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).float().eval()


def _token_losses(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: torch.Tensor
) -> torch.Tensor:
    logits = model(input_ids=input_ids, use_cache=False, **kwargs).logits
    return F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )


@pytest.mark.parametrize("mode", ["split", "whole"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_document_losses_equal_documents_alone(tmp_path: Path, attention: str, mode: str) -> None:
    """Whole packing (the hole: it did not exist) must hold every document whole, each with its loss alone."""
    model = _model(attention)
    docs = _docs(24, seed=0)
    cfg = DataConfig(source="jsonl", path="x.jsonl", seq_len=24, pack_mode=mode)
    rows = rows_of(docs, cfg, bos=[])[0]
    batch = data_lib.collate(rows, list(range(len(rows))))
    with torch.no_grad():
        packed = _token_losses(model, batch["input_ids"], batch["labels"], position_ids=batch["position_ids"])
        packed = packed.view(batch["labels"].shape)
        # The documents whose tokens all lie in one row, found by their start; the others span two rows.
        starts = batch["position_ids"] == 0
        compared, total_alone = 0, 0.0
        for row in range(len(rows)):
            last = (
                len(rows[row]) if mode == "whole" else int((batch["labels"][row] != -100).nonzero().max()) + 2
            )
            bounds = [*starts[row].nonzero().flatten().tolist(), last]
            for begin, end in zip(bounds, bounds[1:], strict=False):
                segment = batch["input_ids"][row, begin:end]
                alone = _token_losses(model, segment[None], batch["labels"][row, begin:end][None])
                assert torch.allclose(packed[row, begin:end], alone, atol=1e-5), (row, begin)
                total_alone += float(alone.sum())
                # Split rows hold a document's EOS as an input; whole rows hold the document's own row.
                matches = [d for d in docs if d.tokens[: len(d) - (mode == "whole")] == segment.tolist()]
                if matches:  # a whole document: its loss run one by one, as an unpacked row
                    sample = document_sample(matches[0], seq_len=64)
                    assert sample is not None
                    single = _token_losses(model, sample.input_ids[None], sample.labels[None]).sum()
                    assert abs(float(single) - float(packed[row, begin:end].sum())) <= 1e-5
                    compared += 1
        assert compared == len(docs) if mode == "whole" else compared >= 12
        # The trainer's loss passes the position ids: the packed batch's sum is the sum of the documents'.
        trainer = CausalLMTrainer(tiny_recipe(tmp_path))
        loss_sum, tokens = trainer.loss(model, batch)
        assert abs(float(loss_sum) - total_alone) <= 1e-4 * max(1.0, total_alone / 100)
        assert int(tokens) == int((batch["labels"] != -100).sum())
        # Without position ids, attention crosses documents and the losses differ.
        crossing = _token_losses(model, batch["input_ids"], batch["labels"]).sum()
        assert abs(float(crossing) - total_alone) > 1e-2


def _packed_recipe(tmp_path: Path) -> Path:
    raw = {
        "run": {"name": "packed", "output_dir": str(tmp_path / "run"), "seed": 0},
        "model": {"config": {**TINY_LLAMA, "vocab_size": 256, "max_position_embeddings": 256}},
        "data": {
            "source": "text",
            "path": str(REPO / "data/tiny_corpus.txt"),
            "tokenizer": "byte",
            "seq_len": 256,
            "packing": True,
            "eval_fraction": 0.0,
        },
        "batch": {"global_size": 8, "micro_size": 8},
        "train": {"steps": 3},
        "checkpoint": {"at_end": False},
        "output": {"progress": "off"},
        "strategies": {
            "precision": "fp32",
            "sharding": "none",
            "checkpointing": "none",
            "optimizer_states": "fp32",
        },
    }
    path = tmp_path / "packed.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plan_predicts_a_packed_run_within_two_percent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Packed rows make transformers build a 4-D document mask in every layer: the planner traces the plain
    `sdpa` model on batches with position ids, as the run feeds them (traced without, it would miss ~18%)."""
    recipe = _packed_recipe(tmp_path)
    planning = CausalLMTrainer(CausalLMRecipe.load(recipe))
    assert "position_ids" in planning.planning_batch(2)
    assert main(["plan", str(recipe), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]["peak"]
    assert main(["profile", str(recipe), "--steps", "3", "--json", "--out", str(tmp_path / "profile")]) == 0
    measured = json.loads(capsys.readouterr().out)["steps"][-1]["peak_bytes"]
    assert predicted == pytest.approx(measured, rel=0.02)
