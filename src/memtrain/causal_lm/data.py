"""Datasets for the built-in causal-LM trainer, from the source `data.source` names (`causal_lm.sources`:
synthetic tokens, local text and jsonl files, datasets through the `datasets` library; a stream is read
by `causal_lm.streaming`).

Every record becomes a document (`causal_lm.sft`: which tokens carry loss for `data.kind`), and documents
become rows (`causal_lm.packing`): one per row, or packed with position ids that restart per document.
A `Sample` holds a row's `input_ids` and next-token `labels`; batches are right-padded with
`labels = -100` where there is no target, so a causal model never attends to padding and the loss
counts only real tokens.

Data order is a pure function of (seed, step): `StepSampler.indices(step)` gives the global step batch
(a stream has its own replayable order). That makes resume exact (the data position *is* the step) and
lets the trainer re-split the same batch after an out-of-memory error without losing or repeating a
sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memtrain.causal_lm import packing, sft
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
    """Whether batches carry `position_ids` (packed documents): attention is then masked per document."""
    return cfg.packing and cfg.kind != "preference" and source_of(cfg).tokenized  # pairs: never packed


@dataclass(frozen=True)
class Splits:
    train: list[Sample]
    eval: list[Sample]
    stream: StreamedSamples | None = None  # `data.streaming`: the training samples by step (`train` is empty)


def build_splits(
    cfg: DataConfig,
    vocab_size: int,
    seed: int,
    env: DistEnv | None = None,
    global_batch: int = 1,
    eval_rows: int = 0,
) -> Splits:
    """Samples of the recipe's data, shuffled once by `seed`, with the last `eval_fraction` held out.
    A streamed dataset keeps its training samples in the stream and holds out `eval_rows` samples."""
    source = source_of(cfg)
    if cfg.streaming:
        return _streamed(cfg, source, seed, global_batch, eval_rows)
    samples = source.samples(cfg, vocab_size, seed, env)
    if not samples:
        raise RecipeError([f"data.path: {cfg.path} yields no sample with a target (of at least 2 tokens)"])
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    shuffled = [samples[i] for i in order]
    held_out = int(len(shuffled) * cfg.eval_fraction)
    cut = len(shuffled) - held_out
    return Splits(train=shuffled[:cut], eval=shuffled[cut:])


def _streamed(cfg: DataConfig, source: DataSource, seed: int, global_batch: int, eval_rows: int) -> Splits:
    tokenizer = load_tokenizer(cfg)
    stream = StreamedSamples(
        records=source.records(cfg),
        encode=sft.RecordEncoder(cfg, tokenizer),
        seq_len=cfg.seq_len,
        packing=cfg.packing,
        bos=tokenizer.bos,
        global_batch=global_batch,
        seed=seed,
        eval_fraction=cfg.eval_fraction,
    )
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


def trim_padding(batch: Batch) -> Batch:
    """Drop trailing columns that are padding in every row (exact for right-padded causal batches)."""
    labels = batch["labels"]
    real = (labels != IGNORE_INDEX).any(dim=0).nonzero()
    keep = int(real.max()) + 1 if len(real) else 1
    if keep == labels.shape[1]:
        return batch
    return {k: (v[:, :keep] if v.dim() == 2 else v) for k, v in batch.items()}
