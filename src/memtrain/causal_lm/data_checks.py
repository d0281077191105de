"""Data mistakes found before anything is built (`memtrain validate`, and every trainer's start).

Why here and not at tokenization: a missing column or a tokenizer without a chat template would otherwise
surface minutes into a run, or deep inside `datasets` or jinja with a traceback. These checks load the
tokenizer, read every record of a local text or jsonl file (each must decode, parse and hold the fields
`data.kind` reads as valid Unicode: what training would refuse on any line) but tokenize only the first
records, and read the first records of a `datasets` source (a stream: it may be larger than memory, so
a bad record further in is found by training). Each problem is one line naming the recipe key to change.
"""

from __future__ import annotations

import glob
import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import dataset_source, sft
from memtrain.causal_lm.tokenizer import Tokenizer, load_tokenizer
from memtrain.errors import RecipeError, did_you_mean
from memtrain.jsonfile import check_utf8
from memtrain.recipe import DataConfig

PEEK_RECORDS = 16  # records rendered and tokenized by the check
TEXT_FORMATS = (".json", ".jsonl", ".csv")  # the datasets formats that are text


def data_problems(cfg: DataConfig) -> list[str]:
    """Every problem of the `data:` section found without reading more than the first records."""
    problems = _key_problems(cfg)
    if problems or cfg.source == "synthetic":
        return problems
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except RecipeError as exc:
        return exc.problems
    if cfg.kind == "chat" and tokenizer.chat_template is None:
        return [
            f"data.kind: chat renders conversations with the tokenizer's chat template, and data.tokenizer "
            f"{cfg.tokenizer!r} has none (use a tokenizer directory whose tokenizer_config.json or "
            "chat_template.jinja holds one)"
        ]
    try:
        return _record_problems(cfg, tokenizer)
    except RecipeError as exc:
        return exc.problems


def _key_problems(cfg: DataConfig) -> list[str]:
    problems = []
    for role in cfg.fields:
        if role not in ("text", "messages", "prompt", "completion"):
            roles = ("text", "messages", "prompt", "completion")
            problems.append(f"data.fields.{role}: unknown field{did_you_mean(role, roles)}")
    if cfg.source == "dataset" and not cfg.path:
        problems.append("data.path: required when data.source is 'dataset'")
    if cfg.streaming and cfg.source != "dataset":
        problems.append(f"data.streaming: streams data.source 'dataset' only (not {cfg.source!r})")
    if cfg.kind != "text" and cfg.source in ("synthetic", "text"):
        problems.append(
            f"data.kind: {cfg.kind} reads records (data.source jsonl or dataset), not {cfg.source!r} data"
        )
    return problems


def _record_problems(cfg: DataConfig, tokenizer: Tokenizer) -> list[str]:
    if cfg.source == "text":
        data_lib.read_documents(cfg)
        return []
    if cfg.source == "jsonl":
        records = list(data_lib.read_records(cfg))
        check = sft.RecordEncoder(cfg, tokenizer).check
        for record, where in records:
            check(record, where)
        return _encode_problems(cfg, tokenizer, records)
    _check_text_files(cfg)
    hub = cfg.path is not None and not Path(cfg.path).exists() and not glob.has_magic(cfg.path)
    dataset = dataset_source.load(cfg, streaming=cfg.streaming if hub else True)
    head = list(itertools.islice(dataset_source.records(dataset, cfg.path), PEEK_RECORDS))
    columns = dataset.column_names or (list(head[0][0]) if head else [])
    problems = dataset_source.column_problems(cfg, list(columns))
    return problems or _encode_problems(cfg, tokenizer, head)


def _check_text_files(cfg: DataConfig) -> None:
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


def _encode_problems(
    cfg: DataConfig, tokenizer: Tokenizer, records: Iterable[tuple[Mapping[str, Any], str]]
) -> list[str]:
    encode = sft.RecordEncoder(cfg, tokenizer)
    for record, where in itertools.islice(records, PEEK_RECORDS):
        encode(record, where)  # a RecipeError names the key
    return []
