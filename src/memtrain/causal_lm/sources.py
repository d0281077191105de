"""Data sources by name (`data.source`): what the built-in causal-LM trainer trains on.

Why a registry: the data path used to ask `if cfg.source == ...` in the splits, the validate-time checks
and the vocabulary check. Each source is now one `DataSource` declaring what those places need: whether
it needs `data.path`, reads records with columns (`data.kind` chat / prompt_completion), streams
(`data.streaming`), goes through the tokenizer; its documents (or samples), its records for a stream,
its validate-time problems and the vocabulary its ids span. A new source is one file plus one line,
`DATA_SOURCES.register(MySource())`.

Why the names are checked here, not by the recipe's schema: a source is built on this package's
tokenizer, documents and datasets loading, which import the recipe, so the recipe cannot import the
sources. `data.source` is checked with the rest of the data (`causal_lm.data_checks`), which `memtrain
validate` and the trainer's start both run (a one-line error naming `data.source`), and `memtrain schema`
adds the names to the recipe's schema (`schema_with_sources`). The `data:` section is the built-in
trainer's: a `Trainer` subclass reads its own data.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from memtrain.causal_lm import dataset_source, packing, sft
from memtrain.causal_lm.lines import nested_too_deeply, read_lines, record_too_deep
from memtrain.causal_lm.packing import Sample
from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.streaming import Records
from memtrain.causal_lm.tokenizer import Tokenizer, load_tokenizer
from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError
from memtrain.jsonfile import decode_utf8
from memtrain.registry import Registry

PEEK_RECORDS = 16  # records rendered and tokenized by the validate-time checks


class Vocabulary(NamedTuple):
    size: int  # every token id of the data is below this
    described: str  # where the number comes from, for messages


class DataSource:
    """One `data.source`. A source that goes through the tokenizer gives `documents` (the samples are
    packed from them, or one per row); one that does not overrides `samples`."""

    name: ClassVar[str] = ""
    needs_path: ClassVar[bool] = True  # data.path is required
    reads_records: ClassVar[bool] = False  # records with columns: every data.kind, not only text
    streams: ClassVar[bool] = False  # data.streaming reads `records` epoch by epoch
    tokenized: ClassVar[bool] = True  # text through data.tokenizer into documents
    has_splits: ClassVar[bool] = False  # data.split (and data.eval.split) name a split of data.path

    def documents(self, cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None) -> list[sft.Document]:
        """Every document, in stored order."""
        raise NotImplementedError(f"data.source {self.name!r} gives no documents")

    def records(self, cfg: DataConfig) -> Records:
        """One epoch of (record, where) at each call: a stream (`streams`)."""
        raise NotImplementedError(f"data.source {self.name!r} does not stream")

    def samples(self, cfg: DataConfig, vocab_size: int, seed: int, env: DistEnv | None) -> list[Sample]:
        """Every sample in stored order (`vocab_size`: the model's)."""
        tokenizer = load_tokenizer(cfg.tokenizer)
        return samples_of(self.documents(cfg, tokenizer, env), cfg, tokenizer, env)

    def problems(self, cfg: DataConfig, tokenizer: Tokenizer) -> list[str]:
        """What `memtrain validate` finds wrong in a tokenized source's data (after the tokenizer loaded),
        reading no more than training would need to fail (a `RecipeError` raised counts as its problems)."""
        return []

    def vocabulary(self, cfg: DataConfig) -> Vocabulary | None:
        """The token ids the data can hold (None: as many as the model has)."""
        ids = load_tokenizer(cfg.tokenizer).vocab_size
        return Vocabulary(ids, f"the tokenizer's {ids} tokens (added and special tokens included)")


DATA_SOURCES: Registry[DataSource] = Registry("data.source")


def source_of(cfg: DataConfig) -> DataSource:
    """The source `data.source` names; a one-line `RecipeError` naming the key when none does."""
    return DATA_SOURCES.get(cfg.source)


def samples_of(
    docs: list[sft.Document], cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None = None
) -> list[Sample]:
    """Packed rows (split or whole), or one row per document (documents without a target dropped); the main
    rank prints one line of what became of the documents (`packing.RowsReport`)."""
    rows, report = packing.rows_of(docs, cfg, tokenizer.bos)
    if env is None or env.is_main:
        print(report.line(), file=sys.stderr, flush=True)
    return rows


def encode_problems(
    cfg: DataConfig, tokenizer: Tokenizer, records: Iterable[tuple[Mapping[str, Any], str]]
) -> list[str]:
    """Render and tokenize the first `PEEK_RECORDS` records (a bad one is a `RecipeError` naming the key)."""
    encode = sft.RecordEncoder(cfg, tokenizer)
    for record, where in itertools.islice(records, PEEK_RECORDS):
        if cfg.kind == "preference":
            encode.pair(record, where)
        else:
            encode(record, where)
    return []


# ------------------------------------------------------------------------------------ built-in sources


def synthetic_samples(num: int, seq_len: int, vocab: int, min_len: int, seed: int) -> list[torch.Tensor]:
    """Learnable synthetic sequences: arithmetic progressions modulo the vocabulary, so loss can fall.
    With `min_len > 0` lengths vary uniformly in [min_len, seq_len + 1] (padded batches)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (num,), generator=gen)
    strides = torch.randint(1, min(vocab, 8), (num,), generator=gen)
    if min_len > 0:
        lengths = torch.randint(max(min_len, 2), seq_len + 2, (num,), generator=gen)
    else:
        lengths = torch.full((num,), seq_len + 1)
    positions = torch.arange(seq_len + 1)
    return [(starts[i] + strides[i] * positions[: lengths[i]]) % vocab for i in range(num)]


class SyntheticSource(DataSource):
    """`data.synthetic`: token rows of its own, no file and no tokenizer."""

    name = "synthetic"
    needs_path = False
    tokenized = False

    def samples(self, cfg: DataConfig, vocab_size: int, seed: int, env: DistEnv | None) -> list[Sample]:
        synthetic = cfg.synthetic
        vocab = synthetic.vocab_size or vocab_size
        tokens = synthetic_samples(synthetic.num_samples, cfg.seq_len, vocab, synthetic.min_len, seed)
        return [Sample(t[:-1], t[1:]) for t in tokens]

    def vocabulary(self, cfg: DataConfig) -> Vocabulary | None:
        ids = cfg.synthetic.vocab_size
        return None if ids is None else Vocabulary(ids, f"data.synthetic.vocab_size ({ids})")


def _path(cfg: DataConfig) -> Path:
    """`data.path`; `RecipeError` naming data.path when it is not a file."""
    assert cfg.path is not None
    path = Path(cfg.path)
    if path.exists() and not path.is_file():  # a FIFO is never opened: reading it would wait for a writer
        raise RecipeError([f"data.path: {path} is not a regular file (a directory, a FIFO or a device)"])
    if not path.is_file():
        raise RecipeError([f"data.path: file not found: {path} (relative paths start at {Path.cwd()})"])
    return path


def _read(cfg: DataConfig) -> str:
    """The text of `data.path`; `RecipeError` naming data.path when it is missing, unreadable, not UTF-8
    (with the line of the first bad byte) or has a line over `lines.MAX_LINE_BYTES` (read no further)."""
    path = _path(cfg)
    return decode_utf8(b"".join(line for _, line in read_lines(path, "data.path")), path, "data.path")


class TextSource(DataSource):
    """A text file whose documents are separated by blank lines."""

    name = "text"

    def texts(self, cfg: DataConfig) -> list[str]:
        return [doc.strip() for doc in _read(cfg).split("\n\n") if doc.strip()]

    def documents(self, cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None) -> list[sft.Document]:
        return [sft.text_document(tokenizer, text) for text in self.texts(cfg)]

    def problems(self, cfg: DataConfig, tokenizer: Tokenizer) -> list[str]:
        self.texts(cfg)  # readable, and UTF-8 throughout
        return []


def _decoded(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(
            [f"data.path: {where} is not UTF-8 text (byte {exc.start} of the line); save it as UTF-8"]
        ) from None


class JsonlSource(DataSource):
    """A jsonl file: one record (a JSON object) per line."""

    name = "jsonl"
    reads_records = True

    def read_records(self, cfg: DataConfig) -> Iterator[tuple[Mapping[str, Any], str]]:
        """Each record with where it is (file:line), each line bounded in length and nesting."""
        path = _path(cfg)
        for number, data in read_lines(path, "data.path"):
            where = f"{cfg.path}:{number}"
            line = _decoded(data, where)
            if not line.strip():
                continue
            if record_too_deep(data):
                raise RecipeError([nested_too_deeply("data.path", where)])
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecipeError([f"data.path: {where} is not valid JSON ({exc.msg})"]) from None
            if not isinstance(record, dict):
                raise RecipeError([f"data.path: {where} is not a JSON object"])
            yield record, where

    def documents(self, cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None) -> list[sft.Document]:
        encode = sft.RecordEncoder(cfg, tokenizer)
        return [encode(record, where) for record, where in self.read_records(cfg)]

    def problems(self, cfg: DataConfig, tokenizer: Tokenizer) -> list[str]:
        """Every record must parse and hold the fields `data.kind` reads (what training would refuse on any
        line); only the first are tokenized."""
        records = list(self.read_records(cfg))
        check = sft.RecordEncoder(cfg, tokenizer).check
        for record, where in records:
            check(record, where)
        return encode_problems(cfg, tokenizer, records)


class DatasetSource(DataSource):
    """Records through the `datasets` library (`causal_lm.dataset_source`), loaded whole or streamed."""

    name = "dataset"
    reads_records = True
    streams = True
    has_splits = True

    def records(self, cfg: DataConfig) -> Records:
        dataset = dataset_source.load(cfg, streaming=True)
        return lambda: dataset_source.records(dataset, cfg.path)

    def documents(self, cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None) -> list[sft.Document]:
        return dataset_source.documents(cfg, tokenizer, env)

    def problems(self, cfg: DataConfig, tokenizer: Tokenizer) -> list[str]:
        """The first records only (a dataset may be larger than memory; a bad record further in is found
        by training), after the UTF-8 check of local text files loaded whole."""
        dataset_source.check_text_files(cfg)
        head, columns = dataset_source.head(cfg, PEEK_RECORDS)
        return dataset_source.column_problems(cfg, columns) or encode_problems(cfg, tokenizer, head)


DATA_SOURCES.register(SyntheticSource())
DATA_SOURCES.register(TextSource())
DATA_SOURCES.register(JsonlSource())
DATA_SOURCES.register(DatasetSource())


def schema_with_sources(schema: dict[str, Any]) -> dict[str, Any]:
    """The recipe's JSON schema with `data.source` listing the registered sources (`memtrain schema`)."""
    schema["$defs"]["DataConfig"]["properties"]["source"]["enum"] = list(DATA_SOURCES.names())
    return schema
