"""Data mistakes found before anything is built (`memtrain validate`, and every trainer's start).

Why here and not at tokenization: a missing column or a tokenizer without a chat template would otherwise
surface minutes into a run, or deep inside `datasets` or jinja with a traceback. These checks load the
tokenizer, read every record of a local text or jsonl file (each must decode, parse and hold the fields
`data.kind` reads as valid Unicode: what training would refuse on any line) but tokenize only the first
records, and read the first records of a `datasets` source (a stream: it may be larger than memory, so
a bad record further in is found by training). What a source reads is its own (`causal_lm.sources`: each
source's `problems`); here are the checks every source shares. Each problem is one line naming the
recipe key to change.
"""

from __future__ import annotations

from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.sources import DATA_SOURCES, DataSource, source_of
from memtrain.causal_lm.tokenizer import load_tokenizer
from memtrain.errors import RecipeError, did_you_mean

FIELD_ROLES = ("text", "messages", "prompt", "completion")  # the keys of data.fields


def data_problems(cfg: DataConfig, tokenizer: bool = True) -> list[str]:
    """Every problem of the `data:` section found without reading more than the first records; without
    `tokenizer` (a config-only model whose tokenizer is not there yet: shapes only), the keys alone."""
    try:
        source = source_of(cfg)
    except RecipeError as exc:
        return exc.problems
    problems = _key_problems(cfg, source)
    if problems or not source.tokenized or not tokenizer:
        return problems
    try:
        loaded = load_tokenizer(cfg.tokenizer)
    except RecipeError as exc:
        return exc.problems
    if cfg.kind == "chat" and loaded.chat_template is None:
        return [
            f"data.kind: chat renders conversations with the tokenizer's chat template, and data.tokenizer "
            f"{cfg.tokenizer!r} has none (use a tokenizer directory whose tokenizer_config.json or "
            "chat_template.jinja holds one)"
        ]
    try:
        return source.problems(cfg, loaded)
    except RecipeError as exc:
        return exc.problems


def _key_problems(cfg: DataConfig, source: DataSource) -> list[str]:
    problems = [
        f"data.fields.{role}: unknown field{did_you_mean(role, FIELD_ROLES)}"
        for role in cfg.fields
        if role not in FIELD_ROLES
    ]
    if source.needs_path and not cfg.path:
        problems.append(f"data.path: required when data.source is {cfg.source!r}")
    if cfg.streaming and not source.streams:
        streamed = "', '".join(s.name for s in DATA_SOURCES if s.streams)
        problems.append(f"data.streaming: streams data.source '{streamed}' only (not {cfg.source!r})")
    if cfg.kind != "text" and not source.reads_records:
        readers = " or ".join(s.name for s in DATA_SOURCES if s.reads_records)
        problems.append(
            f"data.kind: {cfg.kind} reads records (data.source {readers}), not {cfg.source!r} data"
        )
    return problems
