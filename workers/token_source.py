"""``data.source: tokens``: the samples of a prepared token corpus, read by each rank itself.

Runs on every rank: one ``TokenSource`` per generation, built by ``workers/runtime.make_source``
and closed by the rank actor when the rank leaves the generation. The format is
``workers/spec/tokens.py``: training sample ``i`` is train window ``WindowOrder(W, seed)``'s
``window(i)``, ``seq_len + 1`` tokens; evaluation sample ``i`` is validation window
``i mod W_validation``, in order. The rank reads the manifest once, then only the byte ranges of
the windows it takes: ``np.memmap`` of the shard files for a corpus on disk, ranged GETs for an
``s3://`` corpus. The driver never reads the corpus.

Prefetch: ``local_batch`` (``workers/data.py``) hints the source at the samples this rank's
data-parallel slice takes in the next step; one background thread reads them while the step
computes. The cache holds at most the hinted step's samples: a hint drops what the one before
it left unread. ``sample`` takes a prefetched window (waiting for its read if still running) or
reads it there and then. ``stats`` counts both and the seconds spent reading.
"""

from __future__ import annotations

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
from workers.spec.tokens import (
    MANIFEST_KEY,
    SplitIndex,
    TokenCorpusError,
    TokenManifest,
    WindowOrder,
    parse_token_manifest,
    shard_ranges,
    window_count,
    window_tokens,
)
from workers.spec.train import TokenCorpusSource

log = logging.getLogger("meshpilot.data")


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
    """What the source read so far: windows taken from the prefetch cache, windows read when
    asked (``sample`` found none prefetched), and seconds spent reading (both threads)."""

    prefetched: int = 0
    read_on_demand: int = 0
    read_s: float = 0.0


class TokenSource:
    """A ``SampleSource`` over a token corpus; see the module docstring. Rank side, loop thread."""

    def __init__(self, corpus: TokenCorpusSource, *, seq_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.uri = corpus.uri
        self.storage = open_storage(corpus.uri, endpoint_url=corpus.endpoint_url, region=corpus.region)
        try:
            self.manifest = read_manifest(self.storage)
            self.train_windows = self._windows("train")
            self.validation_windows = window_count(self.manifest.splits["validation"].tokens, seq_len)
        except BaseException:
            self.storage.close()
            raise
        self.order = WindowOrder(self.train_windows, seed=seed)
        dtype = np.dtype(self.manifest.dtype).newbyteorder("<")
        self.reader: ShardReader = (
            MappedShards(self.storage.root, dtype)
            if isinstance(self.storage, LocalStorage)
            else RangedShards(self.storage, dtype)
        )
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()
        self._cache: dict[int, Future[np.ndarray]] = {}
        self._cache_lock = threading.Lock()
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshpilot-prefetch")

    def _windows(self, split: str) -> int:
        windows = window_count(self.manifest.splits[split].tokens, self.seq_len)
        if windows < 1:
            raise TokenCorpusError(
                f"{self.uri}: the {split} split holds {self.manifest.splits[split].tokens} tokens, fewer than one "
                f"window of training.seq_len + 1 = {self.seq_len + 1}"
            )
        return windows

    # ------------------------------------------------------------------ samples
    def sample(self, index: int) -> torch.Tensor:
        """Training sample ``index``: its window's ``seq_len + 1`` tokens as int64."""
        with self._cache_lock:
            pending = self._cache.pop(index, None)
        if pending is not None:
            tokens = pending.result()
            with self._stats_lock:
                self.stats.prefetched += 1
        else:
            tokens = self._read_train(index)
            with self._stats_lock:
                self.stats.read_on_demand += 1
        return torch.from_numpy(tokens.astype(np.int64))

    def eval_sample(self, index: int) -> torch.Tensor:
        """Evaluation sample ``index``: the validation stream's windows in order, wrapping around."""
        if self.validation_windows < 1:
            raise TokenCorpusError(
                f"{self.uri}: the validation split holds {self.manifest.splits['validation'].tokens} tokens, fewer "
                f"than one window of training.seq_len + 1 = {self.seq_len + 1}"
            )
        window = index % self.validation_windows
        return torch.from_numpy(self._read_window(self.manifest.splits["validation"], window).astype(np.int64))

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
        """Cancel reads not started, wait for the one in flight (the thread ends), release storage."""
        with self._cache_lock:
            self._cache.clear()
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self.reader.close()
        self.storage.close()

    # ------------------------------------------------------------------ reading
    def _read_train(self, index: int) -> np.ndarray:
        return self._read_window(self.manifest.splits["train"], self.order.window(index))

    def _read_window(self, split: SplitIndex, window: int) -> np.ndarray:
        started = time.perf_counter()
        start, stop = window_tokens(window, self.seq_len)
        pieces = [
            self.reader.read(key, begin, end)
            for key, begin, end in shard_ranges(split.shards, start, stop, self.manifest.itemsize)
        ]
        tokens = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        with self._stats_lock:
            self.stats.read_s += time.perf_counter() - started
        if len(tokens) != stop - start:
            raise TokenCorpusError(f"{self.uri}: window {window} read {len(tokens)} tokens, expected {stop - start}")
        return tokens


def read_manifest(storage: StorageBackend) -> TokenManifest:
    """The corpus manifest under ``storage``; ``TokenCorpusError`` when there is none or it is not one."""
    if not storage.exists(MANIFEST_KEY):
        raise TokenCorpusError(
            f"{storage.uri} holds no token corpus ({MANIFEST_KEY} is missing); prepare it with "
            f"meshpilot data prepare ... --out {storage.uri}"
        )
    return parse_token_manifest(storage.get(MANIFEST_KEY), f"{storage.uri.rstrip('/')}/{MANIFEST_KEY}")
