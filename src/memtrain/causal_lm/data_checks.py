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

from memtrain.causal_lm import data as data_lib
from memtrain.causal_lm import mixture
from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.sources import DATA_SOURCES, DataSource, Vocabulary, source_of
from memtrain.causal_lm.tokenizer import Tokenizer, load_tokenizer
from memtrain.errors import RecipeError, did_you_mean

FIELD_ROLES = ("text", "messages", "prompt", "completion")  # the keys of data.fields


def data_problems(cfg: DataConfig, tokenizer: bool = True) -> list[str]:
    """Every problem of the `data:` section found without reading more than the first records (of each
    source of a mixture); without `tokenizer` (a config-only model whose tokenizer is not there yet: shapes
    only), the keys alone."""
    if cfg.mixture is not None:
        if cfg.eval.given:
            return [
                "data.eval: a data.mixture holds out each source's data.eval_fraction; leave data.eval unset "
                "(a separate eval set for a mixture is not supported yet)"
            ]
        return mixture.problems(cfg, lambda entry: data_problems(entry, tokenizer))
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
        return source.problems(cfg, loaded) or _eval_problems(cfg, source, loaded)
    except RecipeError as exc:
        return exc.problems


def _eval_problems(cfg: DataConfig, source: DataSource, tokenizer: Tokenizer) -> list[str]:
    """The `data.eval` set, checked as the training data is, each problem under its data.eval key."""
    if not cfg.eval.given:
        return []
    with data_lib.renamed_for_eval(cfg):
        return [p for eval_cfg in data_lib.eval_configs(cfg) for p in source.problems(eval_cfg, tokenizer)]


def vocabulary(cfg: DataConfig) -> Vocabulary | None:
    """The token ids the data can hold (None: as many as the model has): its source's, or the largest of a
    mixture's sources (None when a source's name is unknown: `data_problems` says so)."""
    configs = [mixture.entry_config(cfg, i) for i in range(len(cfg.mixture))] if cfg.mixture else [cfg]
    try:
        found = [v for c in configs if (v := source_of(c).vocabulary(c)) is not None]
    except RecipeError:
        return None
    return max(found, key=lambda v: v.size, default=None)


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
    if cfg.eval.path is not None and not source.needs_path:
        problems.append(
            f"data.eval.path: data.source {cfg.source!r} reads no file; leave data.eval unset to hold out "
            "data.eval_fraction"
        )
    if cfg.eval.split is not None and not source.has_splits:
        split = " or ".join(s.name for s in DATA_SOURCES if s.has_splits)
        problems.append(f"data.eval.split: only data.source {split} has splits; give data.eval.path instead")
    if cfg.pack_mode != "auto" and not cfg.packing:
        problems.append(
            f"data.pack_mode: {cfg.pack_mode} packs rows, and data.packing is false (set data.packing: true, "
            "or leave data.pack_mode at auto)"
        )
    if cfg.kind != "text" and not source.reads_records:
        readers = " or ".join(s.name for s in DATA_SOURCES if s.reads_records)
        problems.append(
            f"data.kind: {cfg.kind} reads records (data.source {readers}), not {cfg.source!r} data"
        )
    return problems
