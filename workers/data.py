"""Deterministic samples keyed by a global sample index, split over whatever mesh exists.

Runs on every rank. Step ``k`` (1-based) consumes samples
``[(k - 1) * global_batch, k * global_batch)``; data-parallel slice ``d`` of ``dp`` takes a
contiguous ``global_batch / dp`` of them. The sample a given index names never depends on the
mesh, so a shrink, a grow or a restore neither skips nor repeats one: the step number *is* the
data cursor. Because the indices a step takes follow from the step alone, ``local_batch`` tells
the source which samples this slice takes next (``prefetch``), so a source that reads from
storage can fetch them while the step computes.

A sample is ``seq_len`` inputs and their labels (``Sample``): the token each position is taught
to predict, or ``IGNORE_INDEX`` where nothing trains (a masked prompt, the last token of a
packed document, padding). A sample packed from whole documents also says which document each
token belongs to; the model restarts positions and fences attention at each document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elastic.spec import samples_per_rank

# What torch's cross entropy skips (its default ignore_index, also transformers' label convention).
IGNORE_INDEX = -100


@dataclass(frozen=True)
class Sample:
    """One training or evaluation sample, or (``Batch``) rows of them; tensors are int64.

    ``inputs`` [..., seq]; ``labels`` [..., seq], ``IGNORE_INDEX`` where nothing trains;
    ``documents`` [..., seq] (packing by documents, else None): each token's document number
    within its row, 0, 0, 1, 1, 1, 2, ...; padding at the end of a row is one more document.
    """

    inputs: torch.Tensor
    labels: torch.Tensor
    documents: torch.Tensor | None = None

    @classmethod
    def window(cls, tokens: torch.Tensor, trained: torch.Tensor | None = None) -> Sample:
        """A window of ``seq_len + 1`` stream tokens: inputs ``[:-1]``, labels ``[1:]``, where a
        label trains only when its token's ``trained`` flag (the corpus's loss mask) is set."""
        tokens = tokens.long()
        labels = tokens[1:]
        if trained is not None:
            labels = torch.where(trained[1:].bool(), labels, IGNORE_INDEX)
        return cls(inputs=tokens[:-1], labels=labels)

    @classmethod
    def packed(
        cls, tokens: torch.Tensor, piece_lengths: Sequence[int], *, seq_len: int, trained: torch.Tensor | None = None
    ) -> Sample:
        """Whole documents (or pieces of one) laid end to end, ``piece_lengths`` tokens each, then
        padded to ``seq_len``: a token's label is the next token of the same piece when that one
        trains; the last token of a piece and the padding (one more document) predict nothing."""
        count, pieces = len(tokens), len(piece_lengths)
        padding = seq_len - count
        documents = torch.repeat_interleave(torch.arange(pieces), torch.as_tensor(piece_lengths, dtype=torch.long))
        documents = torch.cat([documents, torch.full((padding,), pieces)])
        inputs = torch.cat([tokens.long(), torch.zeros(padding, dtype=torch.long)])  # padding's ids never matter
        trains = torch.zeros(seq_len, dtype=torch.bool)
        trains[:-1] = documents[1:] == documents[:-1]  # the next token is of the same piece
        trains[count - 1 :] = False  # the last piece's last token, and the padding
        if trained is not None:
            trains[: count - 1] &= trained[1:count].bool()
        following = torch.cat([inputs[1:], inputs.new_zeros(1)])
        return cls(inputs=inputs, labels=torch.where(trains, following, IGNORE_INDEX), documents=documents)

    @property
    def trained_tokens(self) -> int:
        """How many labels train (a host sync when the tensors are on a device)."""
        return int(torch.count_nonzero(self.labels != IGNORE_INDEX))


@dataclass(frozen=True)
class Batch(Sample):
    """Rows of samples, [rows, seq] each, as a data-parallel slice feeds them to its model."""

    @classmethod
    def stack(cls, samples: Sequence[Sample]) -> Batch:
        packed = [sample.documents for sample in samples if sample.documents is not None]
        documents = torch.stack(packed) if packed and len(packed) == len(samples) else None
        return cls(
            inputs=torch.stack([sample.inputs for sample in samples]),
            labels=torch.stack([sample.labels for sample in samples]),
            documents=documents,
        )

    def __len__(self) -> int:
        return len(self.inputs)

    def to(self, device: torch.device) -> Batch:
        return self._each(lambda tensor: tensor.to(device))

    def rows(self, rows: slice) -> Batch:
        return self._each(lambda tensor: tensor[rows])

    def _each(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The same rows with ``change`` applied to each of its tensors."""
        documents = None if self.documents is None else change(self.documents)
        return Batch(inputs=change(self.inputs), labels=change(self.labels), documents=documents)

    def chunk(self, pieces: int) -> list[Batch]:
        """``pieces`` equal runs of rows (microbatches)."""
        size = len(self) // pieces
        return [self.rows(slice(index * size, (index + 1) * size)) for index in range(pieces)]


class SampleSource(Protocol):
    seq_len: int
    # Whether every label of every sample trains (no loss mask, no packing by documents): the
    # trained-token count of a step is then known without counting (global_batch x seq_len).
    every_label_trains: bool

    def sample(self, index: int) -> Sample:
        """Training sample ``index``: ``seq_len`` inputs and their labels."""

    def eval_sample(self, index: int) -> Sample:
        """Evaluation sample ``index`` (0, 1, ...): a fixed set, the same on any mesh, never a
        training sample where the source has a held-out split."""

    def prefetch(self, indices: Sequence[int]) -> None:
        """A hint: these samples are asked for next (the following step's). Sources held in memory ignore it."""

    def close(self) -> None:
        """Release threads and connections; called once when the rank leaves its generation."""


class InMemorySource:
    """The null parts of a source whose samples are computed in memory: nothing to fetch or release."""

    every_label_trains = True

    def prefetch(self, indices: Sequence[int]) -> None:
        return None

    def close(self) -> None:
        return None


class TextSource(InMemorySource):
    """A text tokenized at byte level, cut into non-overlapping windows, shuffled per epoch."""

    def __init__(self, data: bytes, *, seq_len: int, seed: int) -> None:
        if len(data) < seq_len + 2:
            raise ValueError(f"the text has {len(data)} bytes; training.seq_len={seq_len} needs at least {seq_len + 2}")
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(data) - 1) // seq_len
        self._epoch = -1
        self._order: torch.Tensor | None = None

    def sample(self, index: int) -> Sample:
        epoch, position = divmod(index, self.windows)
        start = int(self._order_for(epoch)[position]) * self.seq_len
        return Sample.window(self.tokens[start : start + self.seq_len + 1])

    def eval_sample(self, index: int) -> Sample:
        """The byte-level demo text has no held-out split: its windows in order, as written."""
        start = (index % self.windows) * self.seq_len
        return Sample.window(self.tokens[start : start + self.seq_len + 1])

    def _order_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.windows, generator=generator)
            self._epoch = epoch
        assert self._order is not None, "drawn whenever _epoch is set"
        return self._order


class SyntheticSource(InMemorySource):
    """Seeded arithmetic sequences modulo the vocabulary: learnable, so the loss falls."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed

    def sample(self, index: int) -> Sample:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=generator).tolist()
        positions = torch.arange(self.seq_len + 1)
        return Sample.window((start + (stride % 7 + 1) * positions) % self.vocab_size)

    def eval_sample(self, index: int) -> Sample:
        """Sequences of the same kind from another seed's stream (held out by construction)."""
        return SyntheticSource(vocab_size=self.vocab_size, seq_len=self.seq_len, seed=self.seed + 1).sample(index)


def step_samples(step: int, global_batch: int) -> range:
    """Global sample indices of a (1-based) step."""
    return range((step - 1) * global_batch, step * global_batch)


def local_samples(*, step: int, global_batch: int, dp_rank: int, dp: int) -> range:
    """Global sample indices of data-parallel slice ``dp_rank`` of ``dp`` in (1-based) ``step``."""
    per_rank = samples_per_rank(global_batch, dp)
    first = (step - 1) * global_batch + dp_rank * per_rank
    return range(first, first + per_rank)


def local_batch(source: SampleSource, *, step: int, global_batch: int, dp_rank: int, dp: int) -> Batch:
    """This data-parallel slice's samples of ``step``: ``global_batch / dp`` rows of ``seq_len``.

    Then hints the source at the same slice's samples of the next step (``prefetch``)."""
    batch = Batch.stack(
        [source.sample(index) for index in local_samples(step=step, global_batch=global_batch, dp_rank=dp_rank, dp=dp)]
    )
    source.prefetch(local_samples(step=step + 1, global_batch=global_batch, dp_rank=dp_rank, dp=dp))
    return batch
