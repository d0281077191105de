"""Whole-conversation packing (`data.pack_mode: whole`, auto for chat and prompt_completion): every
conversation lies whole in one row, exactly its unpacked row's tokens and labels; the rows of the shipped
chat example and of a generated 200-row chat file are >= 90% full; a conversation longer than
`data.seq_len` is cut or left out (`data.overlong`) and counted in the data-build log line; a stream packs
whole in a bounded window and replays the same rows by step.

The hole these close: rows used to be cut every seq_len tokens of the joined conversations, so most rows
began inside a conversation and its answers trained without their question."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from memtrain.causal_lm.data_checks import data_problems
from memtrain.causal_lm.packing import (
    Sample,
    WholePacker,
    best_fit_decreasing,
    document_sample,
    pack_whole,
    rows_of,
)
from memtrain.causal_lm.recipe import CausalLMRecipe, DataConfig
from memtrain.causal_lm.sft import IGNORE_INDEX, Document, RecordEncoder
from memtrain.causal_lm.sources import samples_of, source_of
from memtrain.causal_lm.streaming import StreamedSamples
from memtrain.causal_lm.tokenizer import Tokenizer, load_tokenizer

from helpers import REPO

TOKENIZER = str(REPO / "data/tiny-sft-tokenizer")
CHAT = str(REPO / "data/tiny_chat.jsonl")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def shipped() -> DataConfig:
    """The data section of the shipped CPU fine-tuning recipe (chat, seq_len 128, packing on, pack_mode
    auto), its paths made absolute."""
    recipe = CausalLMRecipe.load(REPO / "recipes/tests/tiny-sft.yaml", [f"data.path={CHAT}"])
    return recipe.data.model_copy(update={"tokenizer": TOKENIZER})


@pytest.fixture(scope="module")
def chat_docs(shipped: DataConfig, tokenizer: Tokenizer) -> list[Document]:
    return source_of(shipped).documents(shipped, tokenizer, None)


def _segments(row: Sample) -> list[tuple[list[int], list[int]]]:
    """The row cut at its document starts: (inputs, labels) of each segment."""
    assert row.starts is not None
    bounds = [*row.starts.nonzero().flatten().tolist(), len(row)]
    return [
        (row.input_ids[a:b].tolist(), row.labels[a:b].tolist())
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def _alone(doc: Document, seq_len: int) -> tuple[list[int], list[int]]:
    sample = document_sample(doc, seq_len)
    assert sample is not None
    return sample.input_ids.tolist(), sample.labels.tolist()


def _key(segment: tuple[list[int], list[int]]) -> str:
    return json.dumps(segment)


def _fill(rows: list[Sample], seq_len: int) -> float:
    return sum(len(r) for r in rows) / (len(rows) * seq_len)


def test_every_conversation_is_whole_in_one_row(
    shipped: DataConfig, chat_docs: list[Document], tokenizer: Tokenizer
) -> None:
    """Each row starts at a conversation, and its segments are exactly the conversations' own unpacked
    rows, each conversation once: on the shipped chat data (24-52 tokens, rows of 128)."""
    rows = samples_of(chat_docs, shipped, tokenizer)
    assert all(r.starts is not None and bool(r.starts[0]) for r in rows)
    assert all(len(r) <= shipped.seq_len for r in rows)
    packed = Counter(_key(s) for r in rows for s in _segments(r))
    alone = Counter(_key(_alone(d, shipped.seq_len)) for d in chat_docs)
    assert packed == alone and sum(packed.values()) == len(chat_docs) == 192
    assert len(rows) < len(chat_docs) / 3  # packed, not one per row
    # The split packing still there (pack_mode: split) is what cut conversations: most rows start inside one.
    split = samples_of(chat_docs, shipped.model_copy(update={"pack_mode": "split"}), tokenizer)
    inside = sum(1 for r in split if r.starts is not None and not bool(r.starts[0]))
    assert inside > len(split) // 2


def test_rows_are_at_least_90_percent_full(
    tmp_path: Path, shipped: DataConfig, chat_docs: list[Document], tokenizer: Tokenizer
) -> None:
    """Tokens per row >= 90% of seq_len on the shipped chat example and on a generated 200-row chat file of
    1 to 4 exchanges of 1 to 12 words each (best-fit decreasing; the bound is ceil(tokens / seq_len) rows)."""
    rows = samples_of(chat_docs, shipped, tokenizer)
    assert _fill(rows, shipped.seq_len) >= 0.9
    words = "the sun is yellow one five eight plus what repeat color and answer".split()
    rng = random.Random(0)
    lines = []
    for _ in range(200):
        messages = []
        for _turn in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                messages.append({"role": role, "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))})
        lines.append(json.dumps({"messages": messages}))
    path = tmp_path / "chat200.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = shipped.model_copy(update={"path": str(path), "seq_len": 256})
    docs = source_of(cfg).documents(cfg, tokenizer, None)
    assert max(len(d) for d in docs) > 2 * min(len(d) for d in docs)  # varied lengths
    generated = samples_of(docs, cfg, tokenizer)
    assert _fill(generated, cfg.seq_len) >= 0.9
    assert Counter(_key(s) for r in generated for s in _segments(r)) == Counter(
        _key(_alone(d, cfg.seq_len)) for d in docs
    )


def _long_docs() -> list[Document]:
    """Documents of 5, 12 and 30 tokens (4, 11, 29 inputs: three longer than 10) with targets throughout,
    and one of 30 whose targets lie past token 25 (a long prompt: cut to 10 inputs, nothing left to learn)."""
    docs = [Document(list(range(3, 3 + n))) for n in (5, 12, 30, 5, 12)]
    prompt = list(range(3, 33))
    docs.append(Document(prompt, [IGNORE_INDEX] * 25 + prompt[25:]))
    return docs


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_documents_are_cut_or_left_out_and_counted(
    policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = DataConfig(source="jsonl", path="x.jsonl", kind="chat", seq_len=10, overlong=policy)
    docs = _long_docs()
    rows = samples_of(docs, cfg, load_tokenizer("byte"))
    line = capsys.readouterr().err.strip()
    segments = Counter(_key(s) for r in rows for s in _segments(r))
    short = [_alone(d, 10) for d in docs if len(d) <= 11]
    cut = _alone(docs[1], 10)
    assert cut[0] == docs[1].tokens[:10]  # the first seq_len inputs of the 12-token document
    if policy == "truncate":
        expected = [*short, cut, _alone(docs[2], 10), _alone(docs[4], 10)]
        assert "4 longer than data.seq_len cut to data.seq_len (data.overlong: truncate)" in line
        assert "1 left out with no target in the first data.seq_len tokens" in line  # the long prompt
    else:
        expected = short
        assert "4 longer than data.seq_len left out (data.overlong: drop)" in line
        assert "no target" not in line  # the long prompt is counted as overlong, not twice
    assert segments == Counter(_key(s) for s in expected)
    assert line.startswith(
        f"[memtrain] data: 6 documents -> {len(rows)} rows of up to 10 tokens (whole packing"
    )
    assert line.count("\n") == 0


def test_split_packing_stays_the_default_for_text() -> None:
    docs = [Document([3, 4, 5, 6, 7]) for _ in range(4)]
    text = DataConfig(source="jsonl", path="x.jsonl", seq_len=6)
    rows, report = rows_of(docs, text, [])
    assert report.mode == "split" and [len(r) for r in rows] == [6, 6, 6, 1]
    whole, report = rows_of(docs, text.model_copy(update={"pack_mode": "whole"}), [])
    assert report.mode == "whole" and [len(r) for r in whole] == [4, 4, 4, 4]
    prompts = DataConfig(source="jsonl", path="x.jsonl", kind="prompt_completion", seq_len=8)
    assert rows_of(docs, prompts, [])[1].mode == "whole"
    assert rows_of(docs, prompts.model_copy(update={"packing": False}), [])[1].mode == "none"


def test_best_fit_decreasing_puts_each_item_in_the_fullest_bin_it_fits() -> None:
    sizes = [5, 7, 3, 2, 4, 6, 1]
    bins = best_fit_decreasing(sizes, 10)
    # 7 | 6 | 5 open three bins; 4 -> the 6's (room 4: the fullest it fits); 3 -> the 7's; 2, 1 -> the 5's.
    assert bins == [[1, 2], [5, 4], [0, 3, 6]]
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))


def test_pack_mode_needs_packing() -> None:
    cfg = DataConfig(source="synthetic", packing=False, pack_mode="whole")
    assert data_problems(cfg) == [
        "data.pack_mode: whole packs rows, and data.packing is false (set data.packing: true, or leave "
        "data.pack_mode at auto)"
    ]


def _random_docs(count: int, seed: int) -> list[Document]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Document(torch.randint(3, 64, (int(torch.randint(3, 15, (), generator=generator)),)).tolist())
        for _ in range(count)
    ]


def test_a_stream_packs_whole_in_windows() -> None:
    """`WholePacker` packs `window` documents at a time: the rows of each window are `pack_whole`'s."""
    docs = _random_docs(23, seed=1)
    packer = WholePacker(16, "truncate", window=5)
    streamed = [row for doc in docs for row in packer.add(doc)] + packer.flush()
    expected = [row for at in range(0, 23, 5) for row in pack_whole([_own(d) for d in docs[at : at + 5]], 16)]
    assert len(streamed) == len(expected) > 5
    for a, b in zip(streamed, expected, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert a.starts is not None and b.starts is not None and torch.equal(a.starts, b.starts)


def _own(doc: Document) -> Sample:
    sample = document_sample(doc, 16)
    assert sample is not None
    return sample


def test_streamed_whole_packing_is_a_function_of_the_step(tmp_path: Path, tokenizer: Tokenizer) -> None:
    """A streamed chat dataset (40 conversations, ~28 rows an epoch) packed whole: step 16 (past an epoch)
    read after other steps, fresh, and backwards gives the same rows (what exact resume replays), each
    conversation whole. (A small shuffle buffer: the default one would fill over many epochs first.)"""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(Path(CHAT).read_text().splitlines(keepends=True)[:40]))
    cfg = DataConfig(
        source="dataset", path=str(path), kind="chat", tokenizer=TOKENIZER, seq_len=64, streaming=True
    )

    def stream() -> StreamedSamples:
        return StreamedSamples(
            records=source_of(cfg).records(cfg),
            encode=RecordEncoder(cfg, tokenizer),
            seq_len=64,
            packing=True,
            bos=[],
            global_batch=2,
            seed=5,
            eval_fraction=0.0,
            buffer=4,
            whole=True,
        )

    walked, fresh = stream(), stream()
    for step in range(3):
        walked.step_samples(step)
    later, ids = walked.step_samples(16)
    again, _ = fresh.step_samples(16)
    assert ids == [32, 33]
    docs = Counter(_key(_alone(doc, 64)) for doc in source_of(cfg).documents(cfg, tokenizer, None))
    for a, b in zip(later, again, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert all(docs[_key(segment)] for segment in _segments(a))  # whole conversations
    assert torch.equal(walked.step_samples(1)[0][0].input_ids, fresh.step_samples(1)[0][0].input_ids)
