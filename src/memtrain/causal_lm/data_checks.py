"""Data mistakes found before anything is built (`memtrain validate`, and every trainer's start).

Why here and not at tokenization: a missing column or a tokenizer without a chat template would otherwise
surface minutes into a run, or deep inside `datasets` or jinja with a traceback. These checks load the
tokenizer and read the first records only (a stream for `datasets` files), and report each problem as
one line naming the recipe key to change.
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
from memtrain.recipe import DataConfig

PEEK_RECORDS = 16  # records rendered and tokenized by the check


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
        return _encode_problems(cfg, tokenizer, data_lib.read_records(cfg))
    hub = cfg.path is not None and not Path(cfg.path).exists() and not glob.has_magic(cfg.path)
    dataset = dataset_source.load(cfg, streaming=cfg.streaming if hub else True)
    head = list(itertools.islice(dataset_source.records(dataset), PEEK_RECORDS))
    columns = dataset.column_names or (list(head[0][0]) if head else [])
    problems = dataset_source.column_problems(cfg, list(columns))
    return problems or _encode_problems(cfg, tokenizer, head)


def _encode_problems(
    cfg: DataConfig, tokenizer: Tokenizer, records: Iterable[tuple[Mapping[str, Any], str]]
) -> list[str]:
    encode = sft.RecordEncoder(cfg, tokenizer)
    for record, where in itertools.islice(records, PEEK_RECORDS):
        encode(record, where)  # a RecipeError names the key
    return []
