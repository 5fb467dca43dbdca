"""``data.source: tokens``: the samples of a prepared token corpus, read by each rank itself.

Runs on every rank: one ``TokenSource`` per generation, built by ``workers/runtime.make_source``
and closed by the rank actor when the rank leaves the generation. The format is
``workers/spec/tokens.py``: training sample ``i`` is train sample ``WindowOrder(W, seed)``'s
``window(i)`` (a window of ``seq_len + 1`` tokens, or with ``packing: documents`` the whole
documents of one packed sample); evaluation sample ``i`` is validation sample ``i mod
W_validation``, in order. The rank reads the manifest once (and, packing by documents, each
split's document lengths, from which it packs the samples itself), then only the byte ranges of
the samples it takes, tokens and (a masked corpus) their mask: ``np.memmap`` of the shard files
for a corpus on disk, ranged GETs for an ``s3://`` corpus. The driver never reads the corpus.

Prefetch: ``local_batch`` (``workers/data.py``) hints the source at the samples this rank's
data-parallel slice takes in the next step; background threads read them while the step
computes: one for a corpus on disk, ``RANGED_PREFETCH_THREADS`` side by side for ranged GETs (a
packed sample is a few pieces from anywhere in the stream: a GET each, tokens and mask). The
cache holds at most the hinted step's samples: a hint drops what the one before it left unread.
``sample`` takes a prefetched sample (waiting for its read if still running) or reads it there
and then. ``stats`` counts both and the seconds spent reading.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from checkpointing.local import LocalStorage
from checkpointing.storage import StorageBackend, open_storage
from workers.data import Sample
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    MANIFEST_KEY,
    MASK_DTYPE,
    Packing,
    PackingPlan,
    ShardEntry,
    TokenCorpusError,
    TokenManifest,
    WindowOrder,
    documents_key,
    mask_key,
    pack_documents,
    parse_token_manifest,
    shard_ends,
    shard_ranges,
    window_count,
    window_tokens,
)
from workers.spec.train import TokenCorpusSource

log = logging.getLogger("meshpilot.data")

# Samples read side by side from object storage: a ranged GET waits on the network, not the CPU.
RANGED_PREFETCH_THREADS = 8


class ShardReader(Protocol):
    def read(self, key: str, begin: int, end: int) -> np.ndarray:
        """Bytes ``[begin, end)`` of shard ``key`` as tokens of the corpus dtype."""

    def close(self) -> None:
        """Release files or connections."""


class MappedShards:
    """Shard files on a local (or shared) disk, each mapped once and sliced without a copy."""

    def __init__(self, root: Path, dtype: np.dtype) -> None:
        self.root = root
        self.dtype = dtype
        self._maps: dict[str, np.memmap] = {}
        self._lock = threading.Lock()  # the loop thread and the prefetch thread both map

    def read(self, key: str, begin: int, end: int) -> np.ndarray:
        with self._lock:
            mapped = self._maps.get(key)
            if mapped is None:
                mapped = self._maps[key] = np.memmap(self.root / key, dtype=self.dtype, mode="r")
        itemsize = self.dtype.itemsize
        return mapped[begin // itemsize : end // itemsize]  # a view: the caller's int64 cast copies

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


class RangedShards:
    """Shards in object storage, read by ranged GET (botocore retries transient failures)."""

    def __init__(self, storage: StorageBackend, dtype: np.dtype) -> None:
        self.storage = storage
        self.dtype = dtype

    def read(self, key: str, begin: int, end: int) -> np.ndarray:
        return np.frombuffer(self.storage.get_range(key, begin, end), dtype=self.dtype)

    def close(self) -> None:
        return None


@dataclass
class ReadStats:
    """What the source read so far: samples taken from the prefetch cache, samples read when
    asked (``sample`` found none prefetched), and seconds spent reading (summed over threads)."""

    prefetched: int = 0
    read_on_demand: int = 0
    read_s: float = 0.0


class TokenSource:
    """A ``SampleSource`` over a token corpus; see the module docstring. Rank side, loop thread."""

    def __init__(self, corpus: TokenCorpusSource, *, seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.uri = corpus.uri
        self.packing = corpus.packing
        self.storage = open_storage(corpus.uri, endpoint_url=corpus.endpoint_url, region=corpus.region)
        try:
            self.manifest = read_manifest(self.storage)
            self.plans = self._packing_plans() if self.packing == Packing.DOCUMENTS else {}
            self.train_windows = self._windows("train")
            self.validation_windows = self._count("validation")
        except BaseException:
            self.storage.close()
            raise
        # Every label trains only when nothing is masked and no document boundary drops one.
        self.every_label_trains = self.packing == Packing.WINDOWS and not self.manifest.loss_mask
        self.order = WindowOrder(self.train_windows, seed=seed)
        dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        self.reader = self._shard_reader(dtype)
        self.mask_reader = self._shard_reader(np.dtype(MASK_DTYPE)) if self.manifest.loss_mask else None
        splits = self.manifest.splits
        self.shard_ends = {name: shard_ends(split.shards) for name, split in splits.items()}
        # The mask shard beside each token shard (same cut), named once rather than per sample.
        self.mask_shards = {
            name: tuple(dataclasses.replace(shard, key=mask_key(shard.key)) for shard in split.shards)
            for name, split in splits.items()
        }
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._cache: dict[int, Future[Sample]] = {}
        self._cache_lock = threading.Lock()
        threads = 1 if isinstance(self.reader, MappedShards) else RANGED_PREFETCH_THREADS
        self._prefetcher = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="meshpilot-prefetch")

    def _shard_reader(self, dtype: np.dtype) -> ShardReader:
        if isinstance(self.storage, LocalStorage):
            return MappedShards(self.storage.root, dtype)
        return RangedShards(self.storage, dtype)

    def _packing_plans(self) -> dict[str, PackingPlan]:
        """Both splits' documents packed into samples (``packing: documents``), from their lengths."""
        if not self.manifest.has_documents:
            raise TokenCorpusError(
                f"{self.uri} stores no document lengths (a version-1 corpus): data.packing=documents needs them; "
                "prepare it again with meshpilot data prepare, or set data.packing=windows"
            )
        plans = {}
        for split in ("train", "validation"):
            lengths = np.frombuffer(self.storage.get(documents_key(split)), dtype=DOCUMENT_LENGTH_DTYPE)
            if int(lengths.sum()) != self.manifest.splits[split].tokens:
                raise TokenCorpusError(
                    f"{self.uri}: {documents_key(split)} counts {int(lengths.sum())} tokens, the manifest "
                    f"{self.manifest.splits[split].tokens}; prepare the corpus again"
                )
            plans[split] = pack_documents(lengths, self.seq_len)
        log.info(
            "packed %d train documents into %d samples of <= %d tokens, %.1f%% filled (%d documents cut into pieces)",
            self.manifest.splits["train"].documents,
            plans["train"].samples,
            self.seq_len,
            100 * plans["train"].fill,
            plans["train"].cut_documents,
        )
        return plans

    def _count(self, split: str) -> int:
        """Samples of ``split``: windows, or packed samples."""
        if self.packing == Packing.DOCUMENTS:
            return self.plans[split].samples
        return window_count(self.manifest.splits[split].tokens, self.seq_len)

    def _windows(self, split: str) -> int:
        windows = self._count(split)
        if windows < 1:
            raise TokenCorpusError(
                f"{self.uri}: the {split} split holds {self.manifest.splits[split].tokens} tokens, fewer than one "
                f"window of training.seq_len + 1 = {self.seq_len + 1}"
            )
        return windows

    # ------------------------------------------------------------------ samples
    def sample(self, index: int) -> Sample:
        """Training sample ``index``: ``seq_len`` inputs, their labels (and documents when packed)."""
        with self._cache_lock:
            pending = self._cache.pop(index, None)
        if pending is not None:
            sample = pending.result()
            with self._stats_lock:
                self.stats.prefetched += 1
        else:
            sample = self._read_train(index)
            with self._stats_lock:
                self.stats.read_on_demand += 1
        return sample

    def eval_sample(self, index: int) -> Sample:
        """Evaluation sample ``index``: the validation stream's samples in order, wrapping around."""
        if self.validation_windows < 1:
            raise TokenCorpusError(
                f"{self.uri}: the validation split holds {self.manifest.splits['validation'].tokens} tokens, fewer "
                f"than one window of training.seq_len + 1 = {self.seq_len + 1}"
            )
        return self._read_sample("validation", index % self.validation_windows)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Start reading ``indices`` in the background; drop cached samples not among them."""
        wanted = set(indices)
        with self._cache_lock:
            for index in [i for i in self._cache if i not in wanted]:
                self._cache.pop(index).cancel()
            for index in indices:
                if index not in self._cache:
                    self._cache[index] = self._prefetcher.submit(self._read_train, index)

    def close(self) -> None:
        """Cancel reads not started, wait for those in flight (the threads end), release storage."""
        with self._cache_lock:
            self._cache.clear()
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self.reader.close()
        if self.mask_reader is not None:
            self.mask_reader.close()
        self.storage.close()

    # ------------------------------------------------------------------ reading
    def _read_train(self, index: int) -> Sample:
        return self._read_sample("train", self.order.window(index))

    def _read_sample(self, split_name: str, number: int) -> Sample:
        """Window or packed sample ``number`` of a split, tokens and mask read from its shards."""
        started = time.perf_counter()
        split = self.manifest.splits[split_name]
        plan = self.plans.get(split_name)  # None: windows
        ranges = merged(plan.piece_ranges(number)) if plan is not None else [window_tokens(number, self.seq_len)]
        ends = self.shard_ends[split_name]
        tokens = self._read_ranges(self.reader, split.shards, ends, ranges, self.manifest.itemsize)
        trained = None
        if self.mask_reader is not None:
            masks = self.mask_shards[split_name]
            trained = torch.from_numpy(self._read_ranges(self.mask_reader, masks, ends, ranges, 1).astype(np.bool_))
        with self._stats_lock:
            self.stats.read_s += time.perf_counter() - started
        token_ids = torch.from_numpy(tokens.astype(np.int64))
        if plan is not None:
            return Sample.packed(token_ids, plan.piece_lengths(number).tolist(), seq_len=self.seq_len, trained=trained)
        return Sample.window(token_ids, trained)

    def _read_ranges(
        self,
        reader: ShardReader,
        shards: tuple[ShardEntry, ...],
        ends: np.ndarray,
        ranges: list[tuple[int, int]],
        itemsize: int,
    ) -> np.ndarray:
        """Tokens (or mask bytes) of the stream ranges [start, stop), one after another (``ends``:
        the shards' ``shard_ends``)."""
        values = [self._read_range(reader, shards, ends, tokens, itemsize) for tokens in ranges]
        return values[0] if len(values) == 1 else np.concatenate(values)

    def _read_range(
        self,
        reader: ShardReader,
        shards: tuple[ShardEntry, ...],
        ends: np.ndarray,
        tokens: tuple[int, int],
        itemsize: int,
    ) -> np.ndarray:
        """Tokens (or mask bytes) ``[start, stop)`` of a split's stream, across shard boundaries."""
        start, stop = tokens
        pieces = [reader.read(key, begin, end) for key, begin, end in shard_ranges(shards, start, stop, itemsize, ends)]
        values = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        if len(values) != stop - start:
            raise TokenCorpusError(f"{self.uri}: tokens [{start}, {stop}) read {len(values)} values")
        return values


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Stream ranges in order with each run of adjacent ones joined: one read where pieces touch."""
    joined = ranges[:1]
    for start, stop in ranges[1:]:
        if start == joined[-1][1]:
            joined[-1] = (joined[-1][0], stop)
        else:
            joined.append((start, stop))
    return joined


def read_manifest(storage: StorageBackend) -> TokenManifest:
    """The corpus manifest under ``storage``; ``TokenCorpusError`` when there is none or it is not one."""
    if not storage.exists(MANIFEST_KEY):
        raise TokenCorpusError(
            f"{storage.uri} holds no token corpus ({MANIFEST_KEY} is missing); prepare it with "
            f"meshpilot data prepare ... --out {storage.uri}"
        )
    return parse_token_manifest(storage.get(MANIFEST_KEY), f"{storage.uri.rstrip('/')}/{MANIFEST_KEY}")
