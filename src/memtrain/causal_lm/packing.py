"""Rows of training data from documents: one document per row (padded later), or packed.

Packing joins documents into one token stream, each ended by its EOS (a BOS only at the very start: the
BOS a tokenizer puts in front of every document is dropped from all but the first), and cuts the stream
into rows of `seq_len` inputs whose targets are the next tokens (windows of seq_len + 1 with stride
seq_len, so every token is a target once and nothing is padded).

Why the rows carry where documents start: the position ids restart at 0 at every document (and at every
row), and transformers reads such position ids as packed sequences (`masking_utils`
`find_packed_sequence_indices`) and masks attention across documents. Each document is therefore computed
as if it were alone in its row, and a target is never predicted across a document boundary (the EOS that
ends a document has no target). Packing changes the speed, not the per-document loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memtrain.causal_lm.sft import IGNORE_INDEX, Document


@dataclass(frozen=True)
class Sample:
    """One row: `input_ids` and their next-token `labels` (-100: no target), and for packed rows `starts`,
    True where a document starts (the position ids restart there)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    starts: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input_ids, self.labels, self.starts) if t is not None]


def document_sample(doc: Document, seq_len: int) -> Sample | None:
    """The document as one row (cut to seq_len inputs), or None when it leaves no target."""
    tokens = torch.tensor(doc.tokens[: seq_len + 1], dtype=torch.long)
    if len(tokens) < 2:
        return None
    if doc.labels is None:
        return Sample(tokens[:-1], tokens[1:])  # views of one storage
    labels = torch.tensor(doc.labels[1 : seq_len + 1], dtype=torch.long)
    if not bool((labels != IGNORE_INDEX).any()):
        return None
    return Sample(tokens[:-1], labels)


def position_ids(starts: torch.Tensor) -> torch.Tensor:
    """Positions counted from the last document start (and from the start of the row): `starts` [rows, n]."""
    starts = starts.clone()
    starts[..., 0] = True
    index = torch.arange(starts.shape[-1]).expand_as(starts)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start


class Packer:
    """Documents in, full rows out (`add`); `flush` gives the shorter last row. Deterministic and incremental,
    so a stream packs the same way as a list."""

    def __init__(self, seq_len: int, bos: list[int]) -> None:
        self.seq_len = seq_len
        self.bos = bos
        self._tokens: list[int] = []
        self._labels: list[int] = []
        self._starts: list[bool] = []
        self._head = 0  # rows already cut from the front of the lists
        self._first = True

    def add(self, doc: Document) -> list[Sample]:
        tokens, labels = doc.tokens, doc.labels if doc.labels is not None else doc.tokens
        if not self._first and self.bos and tokens[: len(self.bos)] == self.bos:
            tokens, labels = tokens[len(self.bos) :], labels[len(self.bos) :]
        self._first = False
        if not tokens:
            return []
        self._tokens.extend(tokens)
        self._labels.append(IGNORE_INDEX)  # a document's first token is predicted from nothing of its own
        self._labels.extend(labels[1:])
        self._starts.append(True)
        self._starts.extend([False] * (len(tokens) - 1))
        rows = []
        while len(self._tokens) - self._head > self.seq_len:
            rows.append(self._row(self.seq_len))
        self._compact()
        return [r for r in rows if r is not None]

    def flush(self) -> list[Sample]:
        """The last, shorter row (if it has a target); the packer is empty afterwards."""
        left = len(self._tokens) - self._head
        row = self._row(left - 1) if left >= 2 else None
        self._tokens, self._labels, self._starts, self._head = [], [], [], 0
        return [row] if row is not None else []

    def _row(self, n: int) -> Sample | None:
        """Inputs `[:n]`, targets `[1:n+1]` of what is left; token n stays (the last target is the next input)."""
        h = self._head
        sample = Sample(
            torch.tensor(self._tokens[h : h + n], dtype=torch.long),
            torch.tensor(self._labels[h + 1 : h + n + 1], dtype=torch.long),
            torch.tensor(self._starts[h : h + n], dtype=torch.bool),
        )
        self._head += n
        return sample if bool((sample.labels != IGNORE_INDEX).any()) else None

    def _compact(self) -> None:
        h = self._head
        del self._tokens[:h], self._labels[:h], self._starts[:h]
        self._head = 0


def pack(docs: list[Document], seq_len: int, bos: list[int]) -> list[Sample]:
    """Every document packed into rows of seq_len (the last one may be shorter): the rows `Packer` gives, as
    views of three stream tensors (a few tensors in all, however many rows)."""
    tokens: list[int] = []
    labels: list[int] = []
    offsets: list[int] = []
    for index, doc in enumerate(docs):
        ids, targets = doc.tokens, doc.labels if doc.labels is not None else doc.tokens
        if index and bos and ids[: len(bos)] == bos:
            ids, targets = ids[len(bos) :], targets[len(bos) :]
        if ids:
            offsets.append(len(tokens))
            tokens.extend(ids)
            labels.append(IGNORE_INDEX)
            labels.extend(targets[1:])
    stream = torch.tensor(tokens, dtype=torch.long)
    targets_stream = torch.tensor(labels, dtype=torch.long)
    starts = torch.zeros(len(tokens), dtype=torch.bool)
    starts[torch.tensor(offsets, dtype=torch.long)] = True
    rows = []
    for start in range(0, max(len(tokens) - 1, 0), seq_len):
        end = min(start + seq_len, len(tokens) - 1)
        row = Sample(stream[start:end], targets_stream[start + 1 : end + 1], starts[start:end])
        if bool((row.labels != IGNORE_INDEX).any()):
            rows.append(row)
    return rows
