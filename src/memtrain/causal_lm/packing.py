"""Rows of training data from documents: one document per row (padded later), or packed, split or whole.

Split packing (`data.pack_mode: split`, the default for `kind: text`) joins documents into one token stream,
each ended by its EOS (a BOS only at the very start: the BOS a tokenizer puts in front of every document is
dropped from all but the first), and cuts the stream into rows of `seq_len` inputs whose targets are the
next tokens (windows of seq_len + 1 with stride seq_len, so every token is a target once and nothing is
padded). Right for pretraining text, where a cut document loses nothing.

Whole packing (`data.pack_mode: whole`, the default for `chat` and `prompt_completion`) keeps every document
in one row: a conversation cut in two trains its answers without their question. Each document becomes the
row it would be alone (`document_sample`: its own BOS, inputs `tokens[:-1]`, targets `labels[1:]`), and
those rows are packed best-fit decreasing into rows of at most `seq_len` (`best_fit_decreasing`; TRL's
choice too). A document longer than `seq_len` is cut to it or left out (`data.overlong`), and `RowsReport`
counts them for the log line printed when the data is built.

Why the rows carry where documents start: the position ids restart at 0 at every document (and at every
row), and transformers reads such position ids as packed sequences (`masking_utils`
`find_packed_sequence_indices`) and masks attention across documents. Each document is therefore computed
as if it were alone in its row, and a target is never predicted across a document boundary (the EOS that
ends a document has no target). Packing changes the speed, not the per-document loss.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from memtrain.causal_lm.recipe import DataConfig
from memtrain.causal_lm.sft import IGNORE_INDEX, Document

WHOLE_PACK_WINDOW = 1024  # documents a stream packs together (`WholePacker`: a bounded look-ahead)


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


# ------------------------------------------------------------------------------------ whole documents


def mode_of(cfg: DataConfig) -> str:
    """How documents become rows: `none` (one per row), `split` or `whole` (`data.pack_mode`, auto resolved)."""
    if not cfg.packing:
        return "none"
    if cfg.pack_mode != "auto":
        return cfg.pack_mode
    return "split" if cfg.kind == "text" else "whole"


@dataclass
class RowsReport:
    """What became of the documents: rows, tokens in them, and the documents cut or left out."""

    mode: str
    seq_len: int
    overlong_policy: str
    documents: int = 0
    rows: int = 0
    tokens: int = 0  # input tokens over all rows
    overlong: int = 0  # documents longer than seq_len (cut to it, or left out by `drop`)
    untargeted: int = 0  # documents left out because no target remained (in their first seq_len tokens)

    def line(self) -> str:
        """The log line printed when the data is built."""
        fill = self.tokens / max(self.rows * self.seq_len, 1)
        described = {"none": "one document per row", "split": "split packing", "whole": "whole packing"}
        line = (
            f"[memtrain] data: {self.documents} documents -> {self.rows} rows of up to {self.seq_len} tokens "
            f"({described[self.mode]}, {fill:.1%} of the row tokens filled)"
        )
        if self.mode != "split":
            verb = "cut to data.seq_len" if self.overlong_policy == "truncate" else "left out"
            line += (
                f"; {self.overlong} longer than data.seq_len {verb} (data.overlong: {self.overlong_policy})"
            )
            if self.untargeted:
                line += f"; {self.untargeted} left out with no target in the first data.seq_len tokens"
        return line


def fitted(doc: Document, seq_len: int, overlong: str) -> Sample | None:
    """The document's own row (`document_sample`: cut to `seq_len` inputs), or None when `overlong` is
    `drop` and it is longer, or when it has no target."""
    if len(doc) - 1 > seq_len and overlong == "drop":
        return None
    return document_sample(doc, seq_len)


def best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most `capacity` (every size <= capacity): the largest item
    first, into the fullest bin it fits, else a new bin. Deterministic (ties by index); n log n comparisons
    (the open bins' rooms stay sorted)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, bin), sorted
    for item in order:
        size = sizes[item]
        at = bisect.bisect_left(rooms, (size, -1))
        if at == len(rooms):
            bins.append([item])
            room, index = capacity - size, len(bins) - 1
        else:
            room, index = rooms.pop(at)
            bins[index].append(item)
            room -= size
        if room > 0:
            bisect.insort(rooms, (room, index))
    return bins


def pack_whole(samples: list[Sample], seq_len: int) -> list[Sample]:
    """Documents' own rows packed best-fit decreasing into rows of at most `seq_len`, each document whole
    and starting a segment of its own; the rows are views of three tensors (as in `pack`)."""
    if not samples:
        return []
    bins = best_fit_decreasing([len(s) for s in samples], seq_len)
    placed = [samples[i] for members in bins for i in members]
    tokens = torch.cat([s.input_ids for s in placed])
    labels = torch.cat([s.labels for s in placed])
    starts = torch.zeros(len(tokens), dtype=torch.bool)
    offsets = torch.tensor([0, *(len(s) for s in placed)]).cumsum(0)
    starts[offsets[:-1]] = True
    rows, at = [], 0
    for members in bins:
        end = int(offsets[at + len(members)])
        begin = int(offsets[at])
        rows.append(Sample(tokens[begin:end], labels[begin:end], starts[begin:end]))
        at += len(members)
    return rows


def rows_of(docs: list[Document], cfg: DataConfig, bos: list[int]) -> tuple[list[Sample], RowsReport]:
    """The rows of `docs` as `data.packing`, `data.pack_mode` and `data.overlong` say, and what became of
    the documents."""
    report = RowsReport(mode_of(cfg), cfg.seq_len, cfg.overlong, documents=len(docs))
    if report.mode == "split":
        rows = pack(docs, cfg.seq_len, bos)
    else:
        rows = []
        for doc in docs:
            long = len(doc) - 1 > cfg.seq_len
            sample = fitted(doc, cfg.seq_len, cfg.overlong)
            report.overlong += long
            report.untargeted += sample is None and not (long and cfg.overlong == "drop")
            if sample is not None:
                rows.append(sample)
        if report.mode == "whole":
            rows = pack_whole(rows, cfg.seq_len)
    report.rows = len(rows)
    report.tokens = sum(len(r) for r in rows)
    return rows, report


class WholePacker:
    """Whole packing over a stream: documents are packed `window` at a time (a bounded look-ahead), so the
    rows are a pure function of the stream's order (a resumed run replays them exactly)."""

    def __init__(self, seq_len: int, overlong: str, window: int = WHOLE_PACK_WINDOW) -> None:
        self.seq_len, self.overlong, self.window = seq_len, overlong, window
        self._samples: list[Sample] = []

    def add(self, doc: Document) -> list[Sample]:
        sample = fitted(doc, self.seq_len, self.overlong)
        if sample is not None:
            self._samples.append(sample)
        return self.flush() if len(self._samples) >= self.window else []

    def flush(self) -> list[Sample]:
        rows, self._samples = pack_whole(self._samples, self.seq_len), []
        return rows
