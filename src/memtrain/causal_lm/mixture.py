"""Several data sources mixed by weight (`data.mixture`): which source each sample of the run comes from.

Why each source stays itself: a chat file and a text corpus are tokenized and labelled differently
(`data.kind`, `data.fields`), so each entry is read as a `data:` section of its own (`entry_config`: the
entry's keys over the section's) by its own `DataSource`, into rows packed or padded as usual; only then
are the rows mixed. A problem of an entry is the one-line problem of that `data:` section, its key
renamed to the entry's (`data.path` -> `data.mixture[1].path`).

Why the mix is a formula and not a random draw: resume is exact because the samples of a step are a
pure function of (seed, step) (`causal_lm.data.StepSampler`). Sample `n` of the run goes to a source by
`source_at`, an apportionment computed in O(log sources) from `n` alone: the sources are split in two
halves by weight, and the first `n` samples give the first half `round(n * its share)`, recursively.
Every prefix of the run then holds each source within about one sample per halving of its share, so the
proportions are the weights at every step (a random draw is off by sqrt(n) samples), and sample `n` is
the `k`-th of its source, which a per-source `StepSampler` turns into a row: every row of a source once
per pass over it, a small source repeated (up-sampled) and a large one cut short by its weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from memtrain.causal_lm.packing import Sample
from memtrain.causal_lm.recipe import DataConfig, MixtureSource
from memtrain.causal_lm.sources import source_of
from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError

ENTRY_KEYS = ("path", "source", "kind", "fields", "jsonl_field", "split")
"""The `data:` keys an entry sets for its own source (problems naming them are the entry's)."""

T = TypeVar("T")

SUFFIX_SOURCES = {".jsonl": "jsonl", ".txt": "text"}  # else "dataset" (`entry_source`)


def entry_source(cfg: DataConfig, entry: MixtureSource) -> str:
    """The entry's `source`, else `data.source`, else (`data.source` at its default, synthetic, which has
    no path to mix) the one its path's suffix implies."""
    if entry.source is not None:
        return entry.source
    if cfg.source != "synthetic":
        return cfg.source
    return SUFFIX_SOURCES.get(Path(entry.path).suffix.lower(), "dataset")


def entry_config(cfg: DataConfig, index: int) -> DataConfig:
    """The `data:` section that reads entry `index` alone: its keys over `cfg`'s, no mixture (and not
    streamed: `problems` refuses `data.streaming` with a mixture once, not once per entry)."""
    assert cfg.mixture is not None
    entry = cfg.mixture[index]
    own = {key: getattr(entry, key) for key in ENTRY_KEYS if getattr(entry, key) is not None}
    return cfg.model_copy(
        update={**own, "source": entry_source(cfg, entry), "mixture": None, "streaming": False}
    )


def entry_problem(problem: str, index: int) -> str:
    """`problem` of entry `index`'s `data:` section, with a key of the entry named as the entry's."""
    for key in ENTRY_KEYS:
        if problem.startswith((f"data.{key}:", f"data.{key}.")):
            return f"data.mixture[{index}].{problem.removeprefix('data.')}"
    return problem


def problems(cfg: DataConfig, check: Callable[[DataConfig], list[str]]) -> list[str]:
    """The mixture's own problems, then each entry's (`check` of its `data:` section, keys renamed); a
    problem shared by every entry (the tokenizer) once."""
    assert cfg.mixture is not None
    found = []
    if cfg.path is not None:
        found.append(
            "data.mixture: give data.path (one source) or data.mixture (each entry has its path), not both"
        )
    if cfg.streaming:
        found.append("data.streaming: not with data.mixture (each mixed source is read whole)")
    for index in range(len(cfg.mixture)):
        entry = entry_config(cfg, index)
        try:
            tokenized = source_of(entry).tokenized
        except RecipeError as exc:
            found += [entry_problem(p, index) for p in exc.problems]
            continue
        if not tokenized:
            found.append(
                f"data.mixture[{index}].source: {entry.source} has no path to mix (text | jsonl | dataset)"
            )
            continue
        found += [entry_problem(p, index) for p in check(entry)]
    return list(dict.fromkeys(found))


def entry_samples(
    cfg: DataConfig, index: int, vocab_size: int, seed: int, env: DistEnv | None
) -> list[Sample]:
    """Entry `index`'s rows, in stored order; a problem names the entry's key."""
    entry = entry_config(cfg, index)
    try:
        samples = source_of(entry).samples(entry, vocab_size, seed, env)
    except RecipeError as exc:
        raise RecipeError([entry_problem(p, index) for p in exc.problems]) from None
    if not samples:
        raise RecipeError(
            [
                f"data.mixture[{index}].path: {entry.path} yields no sample with a target (of at least 2 tokens)"
            ]
        )
    return samples


def weights(cfg: DataConfig) -> tuple[float, ...]:
    """The entries' weights, normalised to sum to 1."""
    assert cfg.mixture is not None
    total = math.fsum(e.weight for e in cfg.mixture)
    return tuple(e.weight / total for e in cfg.mixture)


def source_at(shares: tuple[float, ...], position: int) -> tuple[int, int]:
    """(source, k): sample `position` (0-based, over the whole run) is the k-th sample of that source.
    The first n samples give the sources of the first half of `shares` round(n * their share) of them,
    and so on within each half: a function of `position` alone, each prefix within a sample or so of the
    weights."""
    low, high, n = 0, len(shares), position
    while high - low > 1:
        middle = (low + high) // 2
        left = math.fsum(shares[low:middle]) / math.fsum(shares[low:high])
        before = math.floor(left * n + 0.5)
        if math.floor(left * (n + 1) + 0.5) > before:
            high, n = middle, before
        else:
            low, n = middle, n - before
    return low, n


def interleaved(parts: list[list[T]], shares: tuple[float, ...]) -> list[T]:
    """Every item of `parts` (one list per source), in the order `source_at` draws the sources until one
    runs out, then the rest source after source: a prefix (the held-out rows an evaluation of a few
    batches reads) holds each source in its share."""
    merged: list[T] = []
    taken = [0] * len(parts)
    position = 0
    while all(t < len(part) for t, part in zip(taken, parts, strict=True)):
        source, k = source_at(shares, position)
        merged.append(parts[source][k])
        taken[source] = k + 1
        position += 1
    return merged + [item for t, part in zip(taken, parts, strict=True) for item in part[t:]]
