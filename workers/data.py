"""Deterministic samples keyed by a global sample index, split over whatever mesh exists.

Runs on every rank. Step ``k`` (1-based) consumes samples
``[(k - 1) * global_batch, k * global_batch)``; data-parallel slice ``d`` of ``dp`` takes a
contiguous ``global_batch / dp`` of them. The sample a given index names never depends on the
mesh, so a shrink, a grow or a restore neither skips nor repeats one: the step number *is* the
data cursor. Because the indices a step takes follow from the step alone, ``local_batch`` tells
the source which samples this slice takes next (``prefetch``), so a source that reads from
storage can fetch them while the step computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from elastic.spec import samples_per_rank


class SampleSource(Protocol):
    seq_len: int

    def sample(self, index: int) -> torch.Tensor:
        """``seq_len + 1`` token ids: inputs are ``[:-1]``, labels ``[1:]``."""

    def eval_sample(self, index: int) -> torch.Tensor:
        """Evaluation sample ``index`` (0, 1, ...): a fixed set, the same on any mesh, never a
        training sample where the source has a held-out split."""

    def prefetch(self, indices: Sequence[int]) -> None:
        """A hint: these samples are asked for next (the following step's). Sources held in memory ignore it."""

    def close(self) -> None:
        """Release threads and connections; called once when the rank leaves its generation."""


class InMemorySource:
    """The null parts of a source whose samples are computed in memory: nothing to fetch or release."""

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

    def sample(self, index: int) -> torch.Tensor:
        epoch, position = divmod(index, self.windows)
        start = int(self._order_for(epoch)[position]) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].long()

    def eval_sample(self, index: int) -> torch.Tensor:
        """The byte-level demo text has no held-out split: its windows in order, as written."""
        start = (index % self.windows) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].long()

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

    def sample(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=generator).tolist()
        positions = torch.arange(self.seq_len + 1)
        return (start + (stride % 7 + 1) * positions) % self.vocab_size

    def eval_sample(self, index: int) -> torch.Tensor:
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


def local_batch(source: SampleSource, *, step: int, global_batch: int, dp_rank: int, dp: int) -> torch.Tensor:
    """This data-parallel slice's samples of ``step``: a [global_batch / dp, seq_len + 1] tensor.

    Then hints the source at the same slice's samples of the next step (``prefetch``)."""
    batch = torch.stack(
        [source.sample(index) for index in local_samples(step=step, global_batch=global_batch, dp_rank=dp_rank, dp=dp)]
    )
    source.prefetch(local_samples(step=step + 1, global_batch=global_batch, dp_rank=dp_rank, dp=dp))
    return batch
