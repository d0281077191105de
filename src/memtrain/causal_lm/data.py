"""Datasets for the built-in causal-LM trainer: synthetic tokens, local text and jsonl files.

Every sample is a 1-D token tensor of at most `seq_len + 1` tokens (inputs are `[:-1]`, targets `[1:]`).
Batches are right-padded with `labels = -100` where there is no target, so a causal model never attends
to padding and the loss counts only real tokens.

Data order is a pure function of (seed, step): `StepSampler.indices(step)` gives the global step batch.
That makes resume exact (the data position *is* the step) and lets the trainer re-split the same batch
after an out-of-memory error without losing or repeating a sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from memtrain.errors import RecipeError
from memtrain.recipe import DataConfig

IGNORE_INDEX = -100
PAD_ID = 0

Batch = dict[str, torch.Tensor]


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no files, no vocabulary to ship, 256 ids."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class JsonTokenizer:
    """A `tokenizers` JSON file (e.g. a trained BPE), loaded from a local path."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tokenizer = HFTokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids


def load_tokenizer(cfg: DataConfig) -> Tokenizer:
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    path = Path(cfg.tokenizer)
    if not path.is_file():
        raise RecipeError([f'data.tokenizer: file not found: {path} (use "byte" or a tokenizers JSON path)'])
    try:
        return JsonTokenizer(path)
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise RecipeError([f"data.tokenizer: {path} is not a tokenizers JSON file ({exc})"]) from None


def read_documents(cfg: DataConfig) -> list[str]:
    """Documents of a text file (separated by blank lines) or of a jsonl file (one per line)."""
    assert cfg.path is not None
    path = Path(cfg.path)
    if not path.is_file():
        raise RecipeError([f"data.path: file not found: {path} (relative paths start at {Path.cwd()})"])
    text = path.read_text(encoding="utf-8")
    if cfg.source == "text":
        return [doc.strip() for doc in text.split("\n\n") if doc.strip()]
    docs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RecipeError([f"data.path: {path}:{number} is not valid JSON ({exc.msg})"]) from None
        if not isinstance(record, dict) or not isinstance(record.get(cfg.jsonl_field), str):
            raise RecipeError([f"data.jsonl_field: {path}:{number} has no string field {cfg.jsonl_field!r}"])
        docs.append(record[cfg.jsonl_field])
    return docs


def tokenize_samples(
    docs: list[str], tokenizer: Tokenizer, seq_len: int, packing: bool
) -> list[torch.Tensor]:
    """Packing: one token stream cut into windows of seq_len+1 (stride seq_len, so every token is a
    target once). No packing: one document per sample, truncated to seq_len+1 (variable lengths)."""
    window = seq_len + 1
    if packing:
        separator = tokenizer.encode("\n\n")
        stream: list[int] = []
        for doc in docs:
            stream.extend(tokenizer.encode(doc))
            stream.extend(separator)
        tokens = torch.tensor(stream, dtype=torch.long)
        starts = range(0, max(len(tokens) - window + 1, 0), seq_len)
        return [tokens[s : s + window] for s in starts]
    samples = [torch.tensor(tokenizer.encode(doc)[:window], dtype=torch.long) for doc in docs]
    return [s for s in samples if len(s) >= 2]


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


@dataclass(frozen=True)
class Splits:
    train: list[torch.Tensor]
    eval: list[torch.Tensor]


def build_splits(cfg: DataConfig, vocab_size: int, seed: int) -> Splits:
    """Samples of the recipe's data, shuffled once by `seed`, with the last `eval_fraction` held out."""
    if cfg.source == "synthetic":
        vocab = cfg.synthetic.vocab_size or vocab_size
        samples = synthetic_samples(
            cfg.synthetic.num_samples, cfg.seq_len, vocab, cfg.synthetic.min_len, seed
        )
    else:
        tokenizer = load_tokenizer(cfg)
        samples = tokenize_samples(read_documents(cfg), tokenizer, cfg.seq_len, cfg.packing)
    if not samples:
        raise RecipeError([f"data.path: {cfg.path} yields no sample of at least 2 tokens"])
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    shuffled = [samples[i] for i in order]
    held_out = int(len(shuffled) * cfg.eval_fraction)
    cut = len(shuffled) - held_out
    return Splits(train=shuffled[:cut], eval=shuffled[cut:])


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


def collate(samples: list[torch.Tensor], sample_ids: list[int]) -> Batch:
    """Right-pad to the longest sample: input_ids padded with PAD_ID, labels with IGNORE_INDEX."""
    length = max(len(s) for s in samples) - 1
    input_ids = torch.full((len(samples), length), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample) - 1
        input_ids[row, :n] = sample[:-1]
        labels[row, :n] = sample[1:]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "sample_ids": torch.tensor(sample_ids, dtype=torch.long),
    }


def trim_padding(batch: Batch) -> Batch:
    """Drop trailing columns that are padding in every row (exact for right-padded causal batches)."""
    labels = batch["labels"]
    real = (labels != IGNORE_INDEX).any(dim=0).nonzero()
    keep = int(real.max()) + 1 if len(real) else 1
    if keep == labels.shape[1]:
        return batch
    return {k: (v[:, :keep] if v.dim() == 2 else v) for k, v in batch.items()}
