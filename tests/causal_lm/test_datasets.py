"""Data sources: a jsonl file (text, and chat packed whole), a parquet file through `datasets`, and a
streamed dataset each train, and a run resumed from its step-2 checkpoint equals the uninterrupted run bit
for bit. `datasets` tokenizes once (its cache), reads directories, globs, splits and cached hub ids
offline; bad data is a named `memtrain validate` error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import dataset_source, sft
from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.trainer import CausalLMTrainer
from memtrain.cli import main
from memtrain.errors import RecipeError

from helpers import REPO, TINY_LLAMA, tiny_recipe

TOKENIZER = str(REPO / "data/tiny-sft-tokenizer")


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh datasets cache per test (nothing shared with the user's ~/.cache)."""
    import datasets.config

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _parquet(tmp_path: Path, rows: list[dict[str, Any]], name: str) -> Path:
    import datasets

    path = tmp_path / name
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def _sources(tmp_path: Path) -> dict[str, dict[str, Any]]:
    docs = _rows(REPO / "data/tiny_docs.jsonl")
    chats = [
        {"conversation": r["messages"], "id": i} for i, r in enumerate(_rows(REPO / "data/tiny_chat.jsonl"))
    ]
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text("".join(json.dumps({"body": d["text"], "n": i}) + "\n" for i, d in enumerate(docs)))
    return {
        "jsonl": {"source": "jsonl", "path": str(REPO / "data/tiny_docs.jsonl"), "packing": True},
        "parquet-chat": {
            "source": "dataset",
            "path": str(_parquet(tmp_path, chats, "chats.parquet")),
            "kind": "chat",
            "fields": {"messages": "conversation"},
            "tokenizer": TOKENIZER,
            "packing": False,
        },
        "jsonl-chat-whole": {  # conversations packed whole (pack_mode auto), those over seq_len cut
            "source": "jsonl",
            "path": str(REPO / "data/tiny_chat.jsonl"),
            "kind": "chat",
            "tokenizer": TOKENIZER,
            "packing": True,
        },
        "streamed": {
            "source": "dataset",
            "path": str(bodies),
            "fields": {"text": "body"},
            "streaming": True,
            "packing": True,
        },
    }


SECTIONS = {
    "model": {"config": {**TINY_LLAMA, "vocab_size": 320, "attention_dropout": 0.1}},
    "train": {"steps": 4, "warmup_steps": 1, "lr": 1e-2},
    "checkpoint": {"every": 2, "keep": 2, "at_end": True},
    "batch": {"global_size": 8, "micro_size": 4},
}


class CrashesAtStep2(CausalLMTrainer):
    """Dies like a killed job when step 3 starts (after the step-2 checkpoint)."""

    def train_step(self, step: int) -> dict:
        if step == 2:
            raise KeyboardInterrupt("simulated kill")
        return super().train_step(step)


@pytest.mark.parametrize("source", ["jsonl", "parquet-chat", "jsonl-chat-whole", "streamed"])
def test_source_trains_and_resumes_bit_exact(tmp_path: Path, source: str) -> None:
    data = {"seq_len": 32, "eval_fraction": 0.1, **_sources(tmp_path)[source]}
    straight = CausalLMTrainer(tiny_recipe(tmp_path / "a", data=data, **SECTIONS))
    full = straight.fit()
    assert len(full.losses) == 4 and all(torch.isfinite(torch.tensor(full.losses)))
    assert full.losses[-1] < full.losses[0]

    first = CrashesAtStep2(tiny_recipe(tmp_path / "b", data=data, **SECTIONS))
    with pytest.raises(KeyboardInterrupt):
        first.fit()
    second = CausalLMTrainer(tiny_recipe(tmp_path / "b", data=data, **SECTIONS))
    resumed = second.fit(resume=True)

    assert resumed.losses == full.losses[2:]  # exact, not approximate
    assert straight.model is not None and second.model is not None
    for (name, a), (_, b) in zip(
        straight.model.named_parameters(), second.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_streamed_steps_are_a_function_of_the_step(tmp_path: Path) -> None:
    cfg = DataConfig(**{"seq_len": 32, **_sources(tmp_path)["streamed"]})
    walked = data_lib.build_splits(cfg, 256, seed=5, global_batch=4).stream
    fresh = data_lib.build_splits(cfg, 256, seed=5, global_batch=4).stream
    other = data_lib.build_splits(cfg, 256, seed=6, global_batch=4).stream
    assert walked is not None and fresh is not None and other is not None
    for step in range(6):
        walked.step_samples(step)
    later, ids = walked.step_samples(40)  # past one epoch of the ~80 rows
    again, _ = fresh.step_samples(40)
    assert ids == list(range(160, 164))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(later, again, strict=True))
    assert not all(
        torch.equal(a.input_ids, b.input_ids) for a, b in zip(later, other.step_samples(40)[0], strict=True)
    )
    assert walked.step_samples(2)[0][0].input_ids.equal(
        fresh.step_samples(2)[0][0].input_ids
    )  # backwards: replayed


def test_dataset_is_tokenized_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = DataConfig(**{"seq_len": 32, **_sources(tmp_path)["parquet-chat"]})
    calls = []
    encode = sft.RecordEncoder.__call__

    def counting(self: sft.RecordEncoder, record: Any, where: str) -> sft.Document:
        calls.append(where)
        return encode(self, record, where)

    monkeypatch.setattr(sft.RecordEncoder, "__call__", counting)
    first = data_lib.build_splits(cfg, 320, seed=0)
    assert len(calls) == 192
    second = data_lib.build_splits(cfg, 320, seed=0)
    assert len(calls) == 192, "the second build reads datasets' cache"
    assert all(torch.equal(a.labels, b.labels) for a, b in zip(first.train, second.train, strict=True))


def test_directory_glob_and_split(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"train document {i}"}) + "\n" for i in range(30))
    )
    (folder / "test.jsonl").write_text("".join(json.dumps({"text": f"test {i}"}) + "\n" for i in range(5)))
    base = {"source": "dataset", "seq_len": 64, "packing": False, "eval_fraction": 0.0}
    test = data_lib.build_splits(DataConfig(**base, path=str(folder), split="test"), 256, 0).train
    assert sorted(bytes(s.input_ids.tolist()).decode() for s in test) == [f"test {i}\n" for i in range(5)]
    assert len(data_lib.build_splits(DataConfig(**base, path=str(folder)), 256, 0).train) == 30
    assert len(data_lib.build_splits(DataConfig(**base, path=str(folder / "*.jsonl")), 256, 0).train) == 35
    with pytest.raises(RecipeError, match="data.split"):
        data_lib.build_splits(DataConfig(**base, path=str(folder), split="validation"), 256, 0)


def test_no_progress_bars_without_a_terminal(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The hole: datasets' progress bars ("Generating train split", "memtrain: tokenizing") were drawn into
    stderr when it is a log file, not a terminal (here: captured). A validate-style read of the first
    records, a tokenization and a streamed read each go through datasets."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(30)))
    base = {"source": "dataset", "path": str(path), "seq_len": 64, "packing": False, "eval_fraction": 0.0}
    assert len(dataset_source.head(DataConfig(**base), 2)[0]) == 2
    assert len(data_lib.build_splits(DataConfig(**base), 256, 0).train) == 30
    streamed = data_lib.build_splits(DataConfig(**base, streaming=True), 256, 0).stream
    assert streamed is not None and len(streamed.step_samples(0)[0]) == 1
    err = capfd.readouterr().err
    assert "examples/s" not in err and "%|" not in err and "\r" not in err, err


def test_hub_id_is_read_from_the_local_cache_only(datasets_cache: Path) -> None:
    import datasets

    with pytest.raises(RecipeError, match=r"data\.path: someorg/tiny is neither .* local Hugging Face cache"):
        data_lib.build_splits(DataConfig(source="dataset", path="someorg/tiny", seq_len=64), 256, 0)
    # What datasets leaves in its cache after loading a hub dataset (arrow files named after it).
    datasets.load_dataset("json", data_files=str(REPO / "data/tiny_docs.jsonl"), split="train")
    (built,) = [p for p in (datasets_cache / "json").glob("*/*/*") if p.is_dir()]
    cached = datasets_cache / "someorg___tiny" / "default" / "0.0.0" / built.name
    shutil.copytree(built, cached)
    (cached / "json-train.arrow").rename(cached / "tiny-train.arrow")
    splits = data_lib.build_splits(DataConfig(source="dataset", path="someorg/tiny", seq_len=64), 256, 0)
    assert len(splits.train) > 100


def _validate(tmp_path: Path, data: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    raw = {
        "model": {"config": {**TINY_LLAMA, "vocab_size": 320}},
        "data": {"seq_len": 32, **data},
        "output": {"progress": "off"},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(raw))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_validate_names_the_key_of_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    err = _validate(
        tmp_path,
        {"source": "jsonl", "path": str(REPO / "data/tiny_docs.jsonl"), "tokenizer": str(empty)},
        capsys,
    )
    assert "data.tokenizer: the directory" in err and "holds no tokenizer" in err

    parquet = _parquet(tmp_path, [{"body": "some text"}] * 4, "bodies.parquet")
    err = _validate(
        tmp_path, {"source": "dataset", "path": str(parquet), "fields": {"text": "content"}}, capsys
    )
    assert "data.fields.text:" in err and "no column 'content' (columns: body)" in err
    err = _validate(tmp_path, {"source": "dataset", "path": str(parquet)}, capsys)
    assert "data.jsonl_field:" in err and "no column 'text'" in err

    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"text": "hi"})
        + "\n"
    )
    err = _validate(
        tmp_path, {"source": "jsonl", "path": str(chats), "kind": "chat", "tokenizer": TOKENIZER}, capsys
    )
    assert f"data.kind: chat {chats}:2: no messages in field 'messages'" in err

    bare = tmp_path / "bare-tokenizer"
    shutil.copytree(TOKENIZER, bare)
    (bare / "chat_template.jinja").unlink()
    err = _validate(
        tmp_path, {"source": "jsonl", "path": str(chats), "kind": "chat", "tokenizer": str(bare)}, capsys
    )
    assert "data.kind: chat renders conversations with the tokenizer's chat template" in err

    err = _validate(tmp_path, {"source": "jsonl", "path": str(chats), "kind": "chat"}, capsys)  # byte-level
    assert "data.kind: chat" in err and "'byte' has none" in err


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_zero_tokenizes_first(rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 works then meets the others at the barrier (also when its work fails); they work after it."""
    from memtrain.causal_lm import dataset_source
    from memtrain.distributed import DistEnv

    events: list[str] = []
    monkeypatch.setattr(dataset_source, "barrier", lambda env: events.append("barrier"))
    env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    assert dataset_source.main_first(env, lambda: events.append("work") or 7) == 7
    assert events == (["work", "barrier"] if rank == 0 else ["barrier", "work"])

    def fails() -> None:
        raise RecipeError(["data.path: broken"])

    events.clear()
    with pytest.raises(RecipeError):
        dataset_source.main_first(env, fails)
    assert events == ["barrier"]
