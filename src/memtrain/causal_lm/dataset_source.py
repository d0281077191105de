"""`data.source: dataset`: records through the Hugging Face `datasets` library, never from the network.

`data.path` is a local json/jsonl/parquet/arrow/csv file, a glob of them, a directory of them (or one
written by `save_to_disk`), or the id of a hub dataset already in the local cache: every load runs in
datasets' offline mode, so a missing dataset is a one-line error instead of a download.

Why tokenization goes through `Dataset.map`: its result is cached on disk under a fingerprint of the
data, the tokenizer's files and the recipe keys that shape the documents, so a dataset is tokenized
once; on several ranks, rank 0 tokenizes first while the others wait at a barrier, and then read its
cache. A streamed dataset (`data.streaming`) is read record by record instead (`causal_lm.streaming`).
datasets' progress bars show only when stderr is a terminal (`quiet`): a log file would get every redraw.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from memtrain.causal_lm.lines import check_json_lines
from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.sft import ROLES, Document, RecordEncoder, column
from memtrain.causal_lm.tokenizer import Tokenizer
from memtrain.distributed import DistEnv, barrier
from memtrain.errors import RecipeError
from memtrain.jsonfile import check_utf8

TEXT_FORMATS = (".json", ".jsonl", ".csv")  # the datasets formats that are text
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
ENCODING_VERSION = "1"  # bump when the documents of a record change, so cached tokenizations are not reused
T = TypeVar("T")


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """`HF_DATASETS_OFFLINE=1` for the duration: datasets reads its cache and never the network."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """datasets' progress bars off for the duration when stderr is not a terminal: in a log file each
    redraw is a line of its own (the trainer's own bar shows only on a terminal too).
    `HF_DATASETS_DISABLE_PROGRESS_BARS`, when set, decides instead."""
    import datasets.utils

    keep = sys.stderr.isatty() or "HF_DATASETS_DISABLE_PROGRESS_BARS" in os.environ
    if keep or datasets.utils.are_progress_bars_disabled():
        yield
        return
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets.utils.enable_progress_bars()


def load(cfg: DataConfig, streaming: bool) -> Any:
    """The `data.split` of `data.path`: a `datasets.Dataset`, or an `IterableDataset` when streaming."""
    import datasets

    assert cfg.path is not None
    path = Path(cfg.path)
    try:
        with offline(), quiet():
            if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
                return _from_disk(path, cfg.split, streaming)
            check_parquet_files(cfg.path)
            if path.is_file() or glob.has_magic(cfg.path):
                check_json_files(cfg.path)
                return datasets.load_dataset(
                    _builder(cfg.path), data_files=cfg.path, split=cfg.split, streaming=streaming
                )
            return datasets.load_dataset(cfg.path, split=cfg.split, streaming=streaming)
    except RecipeError:
        raise
    except datasets.exceptions.DatasetGenerationError as exc:  # a file its reader cannot parse or decode
        raise RecipeError([f"data.path: datasets cannot read {cfg.path} ({_cause(exc)})"]) from None
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise RecipeError([f"data.split: {' '.join(str(exc).split())}"]) from None
        raise RecipeError([f"data.path: datasets cannot read {cfg.path} ({exc})"]) from None
    except (FileNotFoundError, ConnectionError) as exc:
        if path.exists() or glob.has_magic(cfg.path):
            raise RecipeError([f"data.path: datasets cannot read {cfg.path} ({exc})"]) from None
        cause = " ".join(str(exc).split())[:200]
        raise RecipeError(
            [
                f"data.path: {cfg.path} is neither a local file, glob or directory nor a dataset in the local "
                "Hugging Face cache (offline: nothing is downloaded; load it once with datasets.load_dataset "
                f"where the hub is reachable) ({cause})"
            ]
        ) from None


def _builder(path: str) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in BUILDERS:
        listed = ", ".join(sorted(BUILDERS))
        raise RecipeError(
            [f"data.path: {path}: cannot tell the format from {suffix or 'no'} suffix ({listed})"]
        )
    if glob.has_magic(path) and not glob.glob(path, recursive=True):
        raise RecipeError([f"data.path: no file matches {path}"])
    return BUILDERS[suffix]


def _from_disk(path: Path, split: str, streaming: bool) -> Any:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise RecipeError([f"data.split: {path} has no split {split!r} (splits: {', '.join(loaded)})"])
        loaded = loaded[split]
    return loaded.to_iterable_dataset() if streaming else loaded


def column_problems(cfg: DataConfig, columns: list[str]) -> list[str]:
    """The columns `data.kind` reads that the dataset lacks, each naming its recipe key."""
    problems = []
    for role in ROLES[cfg.kind]:
        name, key = column(cfg, role)
        if name not in columns:
            problems.append(
                f"{key}: {cfg.path} has no column {name!r} (columns: {', '.join(columns)}); "
                f"name the {role} column with data.fields.{role}"
            )
    return problems


def check_text_files(cfg: DataConfig) -> None:
    """The local json, jsonl and csv files of a dataset that is loaded whole must be UTF-8 throughout:
    datasets reads some of them with replacement characters in place of bad bytes, silently. (A streamed
    dataset may be larger than a scan is worth: its bad bytes are found where they are read.)"""
    if cfg.streaming or cfg.path is None:
        return
    names = sorted(glob.glob(cfg.path, recursive=True)) if glob.has_magic(cfg.path) else [cfg.path]
    for name in names:
        path = Path(name)
        if path.is_file() and path.suffix.lower() in TEXT_FORMATS:
            check_utf8(path, "data.path")


def check_json_files(pattern: str) -> None:
    """The local json and jsonl files `pattern` names, bounded before pyarrow parses them
    (`causal_lm.lines`): its native JSON parser crashes the process (SIGSEGV, no message) on a row nested
    100,000 levels deep, and reads a 200 MB line whole. Streamed files too: a crash is worse than a scan,
    and the scan only counts brackets unless a line holds more than the depth limit of them."""
    names = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    for name in names:
        path = Path(name)
        if path.is_file() and path.suffix.lower() in (".json", ".jsonl"):
            check_json_lines(path, "data.path", one_per_line=path.suffix.lower() == ".jsonl")


PARQUET_MAGIC = b"PAR1"  # how every parquet file starts and ends


def check_parquet_files(pattern: str) -> None:
    """Each local parquet file `pattern` names (a file, a glob's files, a directory's files) starts and ends
    with parquet's magic bytes: pyarrow's error on a zeroed or empty one came after a line datasets logs on
    its own and named the glob or folder, not the file."""
    base = Path(pattern)
    if glob.has_magic(pattern):
        names = [Path(name) for name in sorted(glob.glob(pattern, recursive=True))]
    else:
        names = sorted(base.rglob("*.parquet")) if base.is_dir() else [base]
    for path in names:
        if path.suffix.lower() != ".parquet" or not path.is_file():  # (a FIFO is not a file: never opened)
            continue
        size = path.stat().st_size
        with path.open("rb") as handle:
            start = handle.read(len(PARQUET_MAGIC))
            handle.seek(max(0, size - len(PARQUET_MAGIC)))
            end = handle.read(len(PARQUET_MAGIC))
        if size < 3 * len(PARQUET_MAGIC) or start != PARQUET_MAGIC or end != PARQUET_MAGIC:
            what = "empty" if size == 0 else f"{size:,} bytes that do not start and end with parquet's PAR1"
            raise RecipeError(
                [
                    f"data.path: {path} is not a parquet file ({what}); replace it, or leave it out of data.path"
                ]
            )


def head(cfg: DataConfig, count: int) -> tuple[list[tuple[Mapping[str, Any], str]], list[str]]:
    """The first `count` records (streamed, unless a hub dataset is to be loaded whole) and the columns."""
    hub = cfg.path is not None and not Path(cfg.path).exists() and not glob.has_magic(cfg.path)
    dataset = load(cfg, streaming=cfg.streaming if hub else True)
    first = list(itertools.islice(records(dataset, cfg.path), count))
    columns = dataset.column_names or (list(first[0][0]) if first else [])
    return first, list(columns)


def records(dataset: Any, path: str | None) -> Iterator[tuple[Mapping[str, Any], str]]:
    """Each record with where it is (for messages). A record the reader cannot parse or decode (a stream
    reads lazily) is a `RecipeError` naming data.path and the row."""
    rows = iter(dataset)
    for index in itertools.count():
        try:
            record = next(rows)
        except StopIteration:
            return
        except RecipeError:
            raise
        except Exception as exc:  # pyarrow, pandas and datasets raise their own types (ArrowInvalid...)
            raise RecipeError(
                [f"data.path: datasets cannot read {path} at row {index + 1} ({_cause(exc)})"]
            ) from None
        yield record, f"row {index + 1}"


def _cause(exc: BaseException) -> str:
    """A library error in one line: its type, and its message cut to 200 characters."""
    while exc.__cause__ is not None:  # datasets wraps the reader's error
        exc = exc.__cause__
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def documents(cfg: DataConfig, tokenizer: Tokenizer, env: DistEnv | None) -> list[Document]:
    """The documents of a (not streamed) dataset, tokenized once through datasets' cache."""
    tokenized = main_first(env, lambda: _tokenized(cfg, tokenizer))
    docs = []
    for batch in tokenized.iter(batch_size=1000):
        for tokens, labels in zip(batch["tokens"], batch["labels"], strict=True):
            docs.append(Document(tokens, labels or None))
    return docs


def main_first(env: DistEnv | None, work: Callable[[], T]) -> T:
    """`work` on rank 0, then (after a barrier) on the other ranks: they find rank 0's cache. Rank 0 reaches
    the barrier even when `work` fails, so the others fail on their own instead of waiting."""
    if env is None or not env.distributed:
        return work()
    if env.is_main:
        try:
            return work()
        finally:
            barrier(env)
    barrier(env)
    return work()


def _tokenized(cfg: DataConfig, tokenizer: Tokenizer) -> Any:
    dataset = load(cfg, streaming=False)
    problems = column_problems(cfg, dataset.column_names)
    if problems:
        raise RecipeError(problems)
    with quiet():
        return dataset.map(
            _BatchEncoder(RecordEncoder(cfg, tokenizer)),
            batched=True,
            with_indices=True,
            remove_columns=dataset.column_names,
            new_fingerprint=_fingerprint(dataset._fingerprint, cfg),
            desc="memtrain: tokenizing",
        )


class _BatchEncoder:
    """A batch of records (columns of lists) to columns `tokens` and `labels` ([] when every token counts)."""

    def __init__(self, encoder: RecordEncoder) -> None:
        self.encoder = encoder

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[list[int]]]:
        names = list(batch)
        out: dict[str, list[list[int]]] = {"tokens": [], "labels": []}
        for row, index in enumerate(indices):
            doc = self.encoder({name: batch[name][row] for name in names}, f"row {index + 1}")
            out["tokens"].append(doc.tokens)
            out["labels"].append(doc.labels or [])
        return out


def _fingerprint(data: str, cfg: DataConfig) -> str:
    """What the tokenized dataset depends on: the data, the tokenizer's files, the keys shaping documents."""
    digest = hashlib.sha256()
    keys = {
        "kind": cfg.kind,
        "fields": cfg.fields,
        "jsonl_field": cfg.jsonl_field,
        "tokenizer": cfg.tokenizer,
    }
    digest.update(json.dumps([ENCODING_VERSION, data, keys], sort_keys=True).encode())
    source = Path(cfg.tokenizer)
    files = sorted(source.iterdir()) if source.is_dir() else [source] if source.is_file() else []
    for file in files:
        if file.is_file():
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:32]
