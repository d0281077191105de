"""Datasets for the built-in causal-LM trainer, from the source `data.source` names (`causal_lm.sources`:
synthetic tokens, local text and jsonl files, datasets through the `datasets` library; a stream is read
by `causal_lm.streaming`).

Every record becomes a document (`causal_lm.sft`: which tokens carry loss for `data.kind`), and documents
become rows (`causal_lm.packing`): one per row, or packed (split, or each document whole in one row) with
position ids that restart per document.
A `Sample` holds a row's `input_ids` and next-token `labels`; batches are right-padded with
`labels = -100` where there is no target, so a causal model never attends to padding and the loss
counts only real tokens.

Data order is a pure function of (seed, step): `StepSampler.indices(step)` gives the global step batch
(a stream has its own replayable order). That makes resume exact (the data position *is* the step) and
lets the trainer re-split the same batch after an out-of-memory error without losing or repeating a
sample. A mixture (`data.mixture`, `causal_lm.mixture`) keeps it so: each source's rows are built and held
out as one source's are, and `MixtureSampler` gives each position of the run to a source by a formula.
"""

from __future__ import annotations

import contextlib
import glob
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from memtrain.causal_lm import mixture, packing, sft
from memtrain.causal_lm import tokenizer as tokenizer_lib
from memtrain.causal_lm.packing import Sample
from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.sources import DataSource, source_of
from memtrain.causal_lm.streaming import StreamedSamples
from memtrain.causal_lm.tokenizer import ByteTokenizer, JsonTokenizer, Tokenizer
from memtrain.distributed import DistEnv
from memtrain.errors import RecipeError

IGNORE_INDEX = sft.IGNORE_INDEX
PAD_ID = 0

Batch = dict[str, torch.Tensor]

__all__ = ["ByteTokenizer", "JsonTokenizer", "Sample", "Tokenizer"]


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    return tokenizer_lib.load_tokenizer(cfg.tokenizer)


def carries_positions(cfg: DataConfig) -> bool:
    """Whether batches carry `position_ids` (packed documents): attention is then masked per document
    (every mixed source is tokenized; preference pairs are never packed)."""
    return cfg.packing and cfg.kind != "preference" and (cfg.mixture is not None or source_of(cfg).tokenized)


@dataclass(frozen=True)
class Mixed:
    """`train` of a mixture: the rows of each source in turn (`sizes` of them), mixed by `shares`."""

    sizes: tuple[int, ...]
    shares: tuple[float, ...]


@dataclass(frozen=True)
class Splits:
    train: list[Sample]
    eval: list[Sample]
    stream: StreamedSamples | None = None  # `data.streaming`: the training samples by step (`train` is empty)
    mixed: Mixed | None = None  # `data.mixture`


def build_splits(
    cfg: DataConfig,
    vocab_size: int,
    seed: int,
    env: DistEnv | None = None,
    global_batch: int = 1,
    eval_rows: int = 0,
) -> Splits:
    """Samples of the recipe's data, shuffled once by `seed`, with the last `eval_fraction` held out, or
    all of them and the separate `data.eval` set (`eval_samples`). A streamed dataset keeps its training
    samples in the stream and holds out `eval_rows` samples (none with `data.eval`). A mixture splits each
    of its sources so (`_mixed`)."""
    if cfg.mixture is not None:
        return _mixed(cfg, vocab_size, seed, env)
    source = source_of(cfg)
    if cfg.streaming:
        return _streamed(cfg, source, seed, global_batch, eval_rows, vocab_size, env)
    samples = source.samples(cfg, vocab_size, seed, env)
    if not samples:
        raise RecipeError([f"data.path: {cfg.path} yields no sample with a target (of at least 2 tokens)"])
    if cfg.eval.given:
        return Splits(
            train=_held_out(samples, 0.0, seed).train, eval=eval_samples(cfg, vocab_size, seed, env)
        )
    return _held_out(samples, cfg.eval_fraction, seed)


def _held_out(samples: list[Sample], fraction: float, seed: int) -> Splits:
    """`samples` shuffled once by `seed`, the last `fraction` of them held out for evaluation."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    shuffled = [samples[i] for i in order]
    cut = len(shuffled) - int(len(shuffled) * fraction)
    return Splits(train=shuffled[:cut], eval=shuffled[cut:])


def _mixed(cfg: DataConfig, vocab_size: int, seed: int, env: DistEnv | None) -> Splits:
    """Each source of `data.mixture` split as one source is; the training rows source after source, the
    held-out ones interleaved by weight (an evaluation reads the first few batches)."""
    assert cfg.mixture is not None
    shares = mixture.weights(cfg)
    parts = [
        _held_out(mixture.entry_samples(cfg, i, vocab_size, seed, env), cfg.eval_fraction, seed)
        for i in range(len(cfg.mixture))
    ]
    return Splits(
        train=[s for part in parts for s in part.train],
        eval=mixture.interleaved([part.eval for part in parts], shares),
        mixed=Mixed(tuple(len(part.train) for part in parts), shares),
    )


def eval_config(cfg: DataConfig) -> DataConfig:
    """The `data:` section that reads the `data.eval` set: the training data's, with the eval set's path
    and split (each defaulting to the training data's), loaded whole."""
    path, split = cfg.eval.path or cfg.path, cfg.eval.split or cfg.split
    return cfg.model_copy(update={"path": path, "split": split, "streaming": False})


def eval_configs(cfg: DataConfig) -> list[DataConfig]:
    """The `data:` sections that read the `data.eval` set, one per file: a glob reads each file it matches,
    in name order (a `datasets` source reads a glob itself)."""
    eval_cfg, pattern = eval_config(cfg), cfg.eval.path
    if pattern is None or not glob.has_magic(pattern) or source_of(cfg).has_splits:
        return [eval_cfg]
    files = sorted(glob.glob(pattern, recursive=True))
    if not files:
        raise RecipeError([f"data.eval.path: no file matches {pattern}"])
    return [eval_cfg.model_copy(update={"path": f}) for f in files]


def eval_samples(cfg: DataConfig, vocab_size: int, seed: int, env: DistEnv | None) -> list[Sample]:
    """The samples of the `data.eval` set, in stored order, read as the training data is (data.kind, fields,
    tokenizer, seq_len, packing). A problem names the data.eval key to change."""
    source = source_of(cfg)
    with renamed_for_eval(cfg):
        samples = [s for c in eval_configs(cfg) for s in source.samples(c, vocab_size, seed, env)]
    if not samples:
        where = cfg.eval.path or f"split {cfg.eval.split!r} of {cfg.path}"
        raise RecipeError([f"data.eval: {where} yields no sample with a target (of at least 2 tokens)"])
    return samples


@contextlib.contextmanager
def renamed_for_eval(cfg: DataConfig) -> Iterator[None]:
    """A `RecipeError` about data.path / data.split raised meanwhile names data.eval.path / data.eval.split
    instead, where the eval set gives them (the eval set is read through a copy of the `data:` section)."""
    try:
        yield
    except RecipeError as exc:
        raise RecipeError([eval_key(problem, cfg) for problem in exc.problems]) from None


def eval_key(problem: str, cfg: DataConfig) -> str:
    for key, given in (("data.path", cfg.eval.path), ("data.split", cfg.eval.split)):
        if given is not None and problem.startswith(key + ":"):
            return "data.eval." + key.split(".")[1] + problem[len(key) :]
    return problem


def _streamed(
    cfg: DataConfig,
    source: DataSource,
    seed: int,
    global_batch: int,
    eval_rows: int,
    vocab_size: int,
    env: DistEnv | None,
) -> Splits:
    tokenizer = load_tokenizer(cfg)
    stream = StreamedSamples(
        records=source.records(cfg),
        encode=sft.RecordEncoder(cfg, tokenizer),
        seq_len=cfg.seq_len,
        packing=cfg.packing,
        bos=tokenizer.bos,
        global_batch=global_batch,
        seed=seed,
        eval_fraction=0.0 if cfg.eval.given else cfg.eval_fraction,
        whole=packing.mode_of(cfg) == "whole",
        overlong=cfg.overlong,
    )
    if cfg.eval.given:
        return Splits(train=[], eval=eval_samples(cfg, vocab_size, seed, env)[:eval_rows], stream=stream)
    return Splits(train=[], eval=stream.eval_samples(eval_rows), stream=stream)


class StepSampler:
    """Global sample indices for each step: epochs of fresh permutations, a pure function of the step."""

    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self._cached_epoch = -1
        self._perm: list[int] = []

    def indices(self, step: int) -> list[int]:
        return [self._at(p) for p in range(step * self.global_batch, (step + 1) * self.global_batch)]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_samples)
        if epoch != self._cached_epoch:
            gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=gen).tolist()
            self._cached_epoch = epoch
        return self._perm[offset]


class Sampler(Protocol):
    """Global sample indices for each step, a pure function of the step."""

    def indices(self, step: int) -> list[int]: ...


def sampler_for(splits: Splits, global_batch: int, seed: int) -> Sampler:
    """The sampler of the training samples: a mixture's, or epochs over them all."""
    if splits.mixed is not None:
        return MixtureSampler(splits.mixed, global_batch, seed)
    return StepSampler(len(splits.train), global_batch, seed)


class MixtureSampler:
    """Global sample indices for each step of a mixture: position `p` of the run is the k-th sample of
    the source `mixture.source_at` names, and that source's own epochs of permutations give its row."""

    def __init__(self, mixed: Mixed, global_batch: int, seed: int) -> None:
        self.mixed = mixed
        self.global_batch = global_batch
        self.offsets = [0, *accumulate(mixed.sizes)]
        self.sources = [StepSampler(size, 1, seed * 1_000 + i) for i, size in enumerate(mixed.sizes)]

    def indices(self, step: int) -> list[int]:
        return [self._at(p) for p in range(step * self.global_batch, (step + 1) * self.global_batch)]

    def _at(self, position: int) -> int:
        source, k = mixture.source_at(self.mixed.shares, position)
        return self.offsets[source] + self.sources[source].indices(k)[0]


def collate(samples: list[Sample] | list[torch.Tensor], sample_ids: list[int]) -> Batch:
    """Right-pad to the longest sample: input_ids padded with PAD_ID, labels with IGNORE_INDEX; packed rows
    add `position_ids` (restarting at every document). A bare token tensor is a row of its tokens."""
    rows = [s if isinstance(s, Sample) else Sample(s[:-1], s[1:]) for s in samples]
    length = max(len(s) for s in rows)
    input_ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    starts = torch.zeros((len(rows), length), dtype=torch.bool)
    for row, sample in enumerate(rows):
        n = len(sample)
        input_ids[row, :n] = sample.input_ids
        labels[row, :n] = sample.labels
        if sample.starts is not None:
            starts[row, :n] = sample.starts
    batch = {"input_ids": input_ids, "labels": labels}
    if any(s.starts is not None for s in rows):
        batch["position_ids"] = packing.position_ids(starts)
    batch["sample_ids"] = torch.tensor(sample_ids, dtype=torch.long)
    return batch


def trim_padding(batch: Batch, multiple: int = 1) -> Batch:
    """Drop trailing columns that are padding in every row (exact for right-padded causal batches), keeping
    a multiple of `multiple` columns (padding added where the batch is narrower: sequence parallelism
    splits the columns evenly)."""
    labels = batch["labels"]
    real = (labels != IGNORE_INDEX).any(dim=0).nonzero()
    keep = -(-(int(real.max()) + 1 if len(real) else 1) // multiple) * multiple
    width = labels.shape[1]
    if keep == width:
        return batch
    if keep < width:
        return {k: (v[:, :keep] if v.dim() == 2 else v) for k, v in batch.items()}
    pad = {"input_ids": PAD_ID, "labels": IGNORE_INDEX}
    return {
        k: torch.nn.functional.pad(v, (0, keep - width), value=pad.get(k, 0)) if v.dim() == 2 else v
        for k, v in batch.items()
    }
