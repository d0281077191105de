"""Streamed training data (`data.streaming: true`): corpora larger than memory, read record by record.

The step -> samples mapping must stay a pure function of the step, or resume would not be exact. A stream
gives it like this: records are read in their stored order, epoch after epoch; every `HOLD_OUT_EVERY`-th
record is held out for evaluation; the others become samples (packed or one per row) that pass through a
shuffle buffer driven by one generator seeded with `run.seed`. Sample p of that infinite sequence is
therefore always the same, and step s takes samples [s * global_batch, (s + 1) * global_batch). A resumed
run replays the sequence up to its step (it re-reads and re-tokenizes what it skips: exact, at the cost
of reading that far again). Every rank reads the whole stream and keeps its share of each step.

Whole packing (`data.pack_mode`) over a stream packs `packing.WHOLE_PACK_WINDOW` documents at a time, in
stream order (a bounded look-ahead: rows are best-fit within a window, not over the whole corpus), so its
rows too are a function of the stream's order and replay alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from memtrain.causal_lm.packing import WHOLE_PACK_WINDOW, Packer, Sample, WholePacker, fitted
from memtrain.causal_lm.sft import Document
from memtrain.errors import RecipeError

SHUFFLE_BUFFER = 1024  # samples; memory: SHUFFLE_BUFFER rows of seq_len tokens
Records = Callable[[], Iterable[tuple[Mapping[str, Any], str]]]  # one epoch of (record, where)


def hold_out_every(eval_fraction: float) -> int:
    """Every n-th record is held out (0: none)."""
    return round(1 / eval_fraction) if eval_fraction > 0 else 0


class StreamedSamples:
    """The training samples of a stream by step, and the held-out ones, both reproducible from the start."""

    def __init__(
        self,
        records: Records,
        encode: Callable[[Mapping[str, Any], str], Document],
        seq_len: int,
        packing: bool,
        bos: list[int],
        global_batch: int,
        seed: int,
        eval_fraction: float,
        buffer: int = SHUFFLE_BUFFER,
        whole: bool = False,
        overlong: str = "truncate",
    ) -> None:
        self.records, self.encode = records, encode
        self.seq_len, self.packing, self.bos = seq_len, packing, bos
        self.whole, self.overlong = whole, overlong
        self.global_batch, self.seed, self.buffer = global_batch, seed, buffer
        self.every = hold_out_every(eval_fraction)
        self._iterator: Iterator[Sample] | None = None
        self._position = 0
        self._last: tuple[int, list[Sample]] | None = None

    def step_samples(self, step: int) -> tuple[list[Sample], list[int]]:
        """The global batch of `step`, and each sample's position in the stream (its id)."""
        start = step * self.global_batch
        if self._last is not None and self._last[0] == start:
            samples = self._last[1]
        else:
            if self._iterator is None or start < self._position:
                self._iterator, self._position = self._train_stream(), 0
            for _ in itertools.islice(self._iterator, start - self._position):
                pass
            samples = list(itertools.islice(self._iterator, self.global_batch))
            self._position = start + len(samples)
            self._last = (start, samples)
        return samples, list(range(start, start + len(samples)))

    def eval_samples(self, count: int) -> list[Sample]:
        """The first `count` samples of the held-out records (fewer when the stream has fewer)."""
        if not self.every:
            return []
        return list(itertools.islice(self._samples(self._epoch(held_out=True)), count))

    def host_bytes(self) -> int:
        """The shuffle buffer: its rows' input ids, labels and document starts (and, packing whole, the
        look-ahead's documents and the rows packed from them)."""
        rows = self.buffer + (2 * WHOLE_PACK_WINDOW if self.packing and self.whole else 0)
        return rows * self.seq_len * (8 + 8 + 1)

    def _epoch(self, held_out: bool) -> Iterator[Document]:
        for index, (record, where) in enumerate(self.records()):
            if self.every and (index % self.every == self.every - 1) != held_out:
                continue
            if not self.every and held_out:
                return
            yield self.encode(record, where)

    def _samples(self, docs: Iterable[Document]) -> Iterator[Sample]:
        if not self.packing:
            for doc in docs:
                sample = fitted(doc, self.seq_len, self.overlong)
                if sample is not None:
                    yield sample
            return
        packer = WholePacker(self.seq_len, self.overlong) if self.whole else Packer(self.seq_len, self.bos)
        for doc in docs:
            yield from packer.add(doc)
        yield from packer.flush()

    def _train_stream(self) -> Iterator[Sample]:
        """Epochs of training samples through a seeded shuffle buffer, without end."""
        generator = torch.Generator().manual_seed(self.seed)
        buffer: list[Sample] = []
        for epoch in itertools.count():
            produced = 0
            for sample in self._samples(self._epoch(held_out=False)):
                produced += 1
                if len(buffer) < self.buffer:
                    buffer.append(sample)
                    continue
                slot = int(torch.randint(0, self.buffer, (), generator=generator))
                yield buffer[slot]
                buffer[slot] = sample
            if not produced:
                raise RecipeError([f"data.path: the stream yields no training sample (epoch {epoch + 1})"])
