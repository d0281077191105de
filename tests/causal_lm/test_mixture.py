"""`data.mixture`: several sources, each read by its own kind, mixed by weight, resumable.

The hole: a run read one `data.path` (or glob) of one `data.kind`; a chat file and a text corpus could not
be trained on together, let alone in chosen proportions (`data.mixture` was an unknown key, so every test
here failed on the code before it).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import mixture
from memtrain.causal_lm.trainer import CausalLMTrainer, model_problems
from memtrain.errors import RecipeError

from helpers import REPO, TINY_LLAMA, tiny_recipe, tiny_recipe_dict

TOKENIZER = str(REPO / "data/tiny-sft-tokenizer")
MODEL = {"config": {**TINY_LLAMA, "vocab_size": 320}}  # the tokenizer's 320 ids


def _files(directory: Path) -> tuple[str, str]:
    """A chat jsonl (40 conversations) and a text file (documents between blank lines) from data/."""
    directory.mkdir(parents=True, exist_ok=True)
    chat, text = directory / "chat.jsonl", directory / "notes.txt"
    chat.write_text("".join((REPO / "data/tiny_chat.jsonl").read_text().splitlines(True)[:40]))
    text.write_text("".join((REPO / "data/tiny_corpus.txt").read_text().splitlines(True)[:300]))
    return str(chat), str(text)


def _data(chat: str, text: str, **more: Any) -> dict[str, Any]:
    mix = [
        {"path": chat, "weight": 0.7, "kind": "chat"},
        {"path": text, "weight": 0.3},
    ]  # text: .txt, kind text
    return {"tokenizer": TOKENIZER, "seq_len": 32, "mixture": mix, **more}


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory: pytest.TempPathFactory) -> CausalLMTrainer:
    """A trainer over the 0.7 chat / 0.3 text mixture, one document per row (no model built)."""
    tmp_path = tmp_path_factory.mktemp("mix")
    return CausalLMTrainer(tiny_recipe(tmp_path, data=_data(*_files(tmp_path), packing=False), model=MODEL))


def test_proportions_follow_the_weights_over_1000_samples(unpacked: CausalLMTrainer) -> None:
    """Rows counted by what they hold (a chat row has context tokens without a target, a text row none)."""
    assert unpacked.data.mixed is not None
    per_step = unpacked.recipe.batch.global_size
    ids = [i for step in range(1000 // per_step) for i in unpacked.sampler.indices(step)]
    assert len(ids) == 1000
    chat = sum(bool((unpacked.train_samples[i].labels == data_lib.IGNORE_INDEX).any()) for i in ids)
    assert abs(chat / 1000 - 0.7) <= 0.02 and abs((1000 - chat) / 1000 - 0.3) <= 0.02, chat


def test_each_row_of_a_source_once_per_pass_over_it(unpacked: CausalLMTrainer) -> None:
    """Source by source, the first pass over its rows draws every row once (the rows of a source are
    `sizes` consecutive samples, source after source)."""
    mixed = unpacked.data.mixed
    assert mixed is not None and mixed.sizes[0] != mixed.sizes[1]
    draws: dict[int, list[int]] = {0: [], 1: []}
    step = 0
    while any(len(draws[s]) < size for s, size in enumerate(mixed.sizes)):
        for i in unpacked.sampler.indices(step):
            draws[int(i >= mixed.sizes[0])].append(i)
        step += 1
    assert sorted(draws[0][: mixed.sizes[0]]) == list(range(mixed.sizes[0]))
    assert sorted(draws[1][: mixed.sizes[1]]) == list(range(mixed.sizes[0], sum(mixed.sizes)))


def test_held_out_rows_are_interleaved_by_weight(tmp_path: Path) -> None:
    """An evaluation reads the first `train.eval_batches` batches of the held-out rows: they were the
    first source's alone (the rows source after source)."""
    data = _data(*_files(tmp_path), packing=False, eval_fraction=0.5)
    held_out = CausalLMTrainer(tiny_recipe(tmp_path, data=data, model=MODEL)).eval_samples
    chat = [bool((s.labels == data_lib.IGNORE_INDEX).any()) for s in held_out]
    assert 0 < sum(chat) < len(chat)
    assert abs(sum(chat[:20]) - 14) <= 1, chat  # 0.7 of the first 20


def test_every_prefix_of_three_sources_is_within_two_samples_of_its_share() -> None:
    shares = (0.5, 0.3, 0.2)
    counts: Counter[int] = Counter()
    for position in range(1000):
        source, k = mixture.source_at(shares, position)
        assert k == counts[source]  # the k-th sample of its source: drawn in order
        counts[source] += 1
        assert all(abs(counts[s] - share * (position + 1)) <= 2 for s, share in enumerate(shares)), position
    assert [counts[s] for s in range(3)] == [500, 300, 200]
    assert all(mixture.source_at((1.0,), p) == (0, p) for p in range(50))  # one source: every sample


class Records(CausalLMTrainer):
    """Keeps each step's sample ids; dies like a killed job when step `crash_at` (0-based) starts."""

    crash_at: int | None = None

    def step_batch(self, step: int) -> data_lib.Batch:
        batch = super().step_batch(step)
        self.seen = {**getattr(self, "seen", {}), step: batch["sample_ids"].tolist()}
        return batch

    def train_step(self, step: int) -> dict:
        if step == self.crash_at:
            raise KeyboardInterrupt("simulated kill")
        return super().train_step(step)


def test_resume_mid_run_draws_the_same_samples_per_step(tmp_path: Path) -> None:
    """Packed rows of both sources; 6 steps straight, or 3, a kill, and a resume: the same samples at
    every step, each step once, and the same losses."""
    chat, text = _files(tmp_path)
    sections: dict[str, Any] = {
        "data": _data(chat, text),
        "model": MODEL,
        "batch": {"global_size": 4, "micro_size": 4},
        "train": {"steps": 6, "schedule": "wsd", "warmup_steps": 1},
        "checkpoint": {"every": 3, "keep": 2, "at_end": False},
    }
    straight = Records(tiny_recipe(tmp_path / "a", **sections))
    full = straight.fit()

    first = Records(tiny_recipe(tmp_path / "b", **sections))
    first.crash_at = 3
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    resumed = Records(tiny_recipe(tmp_path / "b", **sections))
    rest = resumed.fit(resume=True)

    assert sorted(first.seen) == [0, 1, 2] and sorted(resumed.seen) == [3, 4, 5]
    assert {**first.seen, **resumed.seen} == straight.seen
    assert len({i for ids in straight.seen.values() for i in ids}) > 4  # not one batch over and over
    assert full.losses[3:] == rest.losses


def test_an_entry_reads_the_data_keys_it_leaves_out() -> None:
    """`kind`, `fields`, ... and `source` from `data:`; `source` from the suffix while data.source is the
    synthetic default (which has no path to mix)."""
    from memtrain.causal_lm.recipe import DataConfig

    mix = [{"path": "a.jsonl"}, {"path": "b.txt", "kind": "text"}, {"path": "c/", "source": "jsonl"}]
    by_suffix = DataConfig.model_validate({"kind": "chat", "fields": {"messages": "m"}, "mixture": mix})
    entries = [mixture.entry_config(by_suffix, i) for i in range(3)]
    assert [(e.source, e.kind, e.path) for e in entries] == [
        ("jsonl", "chat", "a.jsonl"),
        ("text", "text", "b.txt"),
        ("jsonl", "chat", "c/"),
    ]
    assert all(e.fields == {"messages": "m"} and e.mixture is None for e in entries)
    given = DataConfig.model_validate({"source": "dataset", "mixture": mix})
    assert [mixture.entry_config(given, i).source for i in range(3)] == ["dataset", "dataset", "jsonl"]


BAD_ENTRIES = [  # (what data.mixture or data: holds, the one line expected to start with)
    ({"mixture": [{"path": "{chat}", "weight": 0}]}, "data.mixture[0].weight: "),
    (
        {"mixture": [{"path": "{chat}", "kind": "chat"}, {"path": "{text}", "kind": "chatt"}]},
        "data.mixture[1].kind: 'chatt'",
    ),
    (
        {"mixture": [{"path": "{chat}", "kind": "chat", "wieght": 2}]},
        'data.mixture[0].wieght: unknown key (did you mean "weight"?)',
    ),
    ({"mixture": [{"weight": 1}]}, "data.mixture[0].path: "),
    ({"mixture": []}, "data.mixture: "),
    ({"eval": "{chat}", "mixture": [{"path": "{text}"}]}, "data.eval: a data.mixture holds out"),
    (
        {"path": "{chat}", "mixture": [{"path": "{text}"}]},
        "data.mixture: give data.path (one source) or data.mixture",
    ),
    (
        {"mixture": [{"path": "{text}"}, {"path": "{chat}.gone", "source": "jsonl"}]},
        "data.mixture[1].path: file not found",
    ),
    ({"mixture": [{"path": "{text}", "kind": "chat"}]}, "data.mixture[0].kind: chat reads records"),
    ({"mixture": [{"path": "{chat}"}, {"path": "{chat}", "kind": "chat"}]}, "data.mixture[0].jsonl_field: "),
    (
        {"mixture": [{"path": "{chat}", "kind": "chat", "fields": {"message": "m"}}]},
        "data.mixture[0].fields.message: unknown field",
    ),
    ({"mixture": [{"path": "{chat}", "source": "jsnl", "kind": "chat"}]}, "data.mixture[0].source: 'jsnl'"),
    (
        {"mixture": [{"path": "{chat}", "source": "synthetic"}]},
        "data.mixture[0].source: synthetic has no path",
    ),
    (
        {"mixture": [{"path": "{chat}", "kind": "chat"}], "streaming": True},
        "data.streaming: not with data.mixture",
    ),
]


def _filled(value: Any, chat: str, text: str) -> Any:
    if isinstance(value, str):
        return value.replace("{chat}", chat).replace("{text}", text)
    if isinstance(value, list):
        return [_filled(v, chat, text) for v in value]
    return {k: _filled(v, chat, text) for k, v in value.items()} if isinstance(value, dict) else value


@pytest.mark.parametrize(("data", "line"), BAD_ENTRIES)
def test_a_bad_mixture_entry_is_one_line_naming_its_key(
    tmp_path: Path, data: dict[str, Any], line: str
) -> None:
    chat, text = _files(tmp_path)
    data = {"tokenizer": TOKENIZER, "seq_len": 32, **_filled(data, chat, text)}
    try:
        problems = model_problems(tiny_recipe(tmp_path, data=data, model=MODEL))
    except RecipeError as exc:
        problems = exc.problems
    assert len(problems) == 1 and problems[0].startswith(line), problems


def test_the_model_vocabulary_is_checked_against_a_mixtures_tokenizer(tmp_path: Path) -> None:
    """A mixture read no `data.source`: the vocabulary check looked at the default (synthetic) source."""
    recipe = tiny_recipe(tmp_path, data=_data(*_files(tmp_path)))  # TINY_LLAMA: 64 ids
    assert model_problems(recipe) == [
        "model.config.vocab_size: 64 is smaller than the tokenizer's 320 tokens (added and special tokens "
        "included); ids past the vocabulary would fail in the embedding"
    ]


def test_validate_exits_2_with_the_entry_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What `memtrain validate` prints for a bad entry: the recipe, and one line naming the entry's key."""
    import yaml

    from memtrain.cli import main

    chat, text = _files(tmp_path)
    data = _data(chat, text)
    data["mixture"][1]["path"] = str(tmp_path / "gone.txt")
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tmp_path, data=data, model=MODEL)))
    assert main(["validate", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"{recipe}: 1 problem" in err and "  - data.mixture[1].path: file not found: " in err, err
    assert "Traceback" not in err
