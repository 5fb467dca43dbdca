"""Token corpora for tests, written straight through the format module and checkpointing.storage.

    corpus = write_corpus(open_storage(uri), train=stream, validation=held_out, vocab_size=256)

The streams are what ``meshpilot data prepare`` would write for some documents (each followed by
its EOS): shards of ``shard_tokens`` tokens, then the manifest, last, as the commit.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from checkpointing.storage import StorageBackend
from workers.spec.tokens import (
    MANIFEST_KEY,
    ShardEntry,
    SplitIndex,
    TokenizerInfo,
    TokenManifest,
    shard_key,
    token_dtype,
)

EOS_ID = 0
TOKENIZER_JSON = b'{"version": "1.0", "model": {"type": "test"}}\n'


@dataclass(frozen=True)
class Corpus:
    manifest: TokenManifest
    train: np.ndarray  # the train split's token stream, int64
    validation: np.ndarray


def documents(count: int, *, vocab_size: int, seed: int, max_length: int = 120) -> np.ndarray:
    """A token stream of ``count`` learnable documents (arithmetic sequences), each ended by EOS."""
    rng = np.random.default_rng(seed)
    pieces = []
    for _ in range(count):
        length = int(rng.integers(8, max_length))
        start, stride = rng.integers(1, vocab_size, size=2)
        pieces.append(1 + (start + (stride % 7 + 1) * np.arange(length)) % (vocab_size - 1))
        pieces.append(np.array([EOS_ID]))
    return np.concatenate(pieces).astype(np.int64)


def write_corpus(
    storage: StorageBackend,
    *,
    train: np.ndarray,
    validation: np.ndarray,
    vocab_size: int = 256,
    shard_tokens: int = 1000,
    tokenizer: bytes = TOKENIZER_JSON,
) -> Corpus:
    """Shards of both splits, then the manifest (put-if-absent: the commit)."""
    dtype = token_dtype(vocab_size)
    splits = {}
    for name, stream in (("train", train), ("validation", validation)):
        shards = []
        for number, start in enumerate(range(0, len(stream), shard_tokens)):
            data = stream[start : start + shard_tokens].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
            key = shard_key(name, number)
            storage.put_bytes(key, data)
            shards.append(ShardEntry(key, len(data) // np.dtype(dtype).itemsize, hashlib.sha256(data).hexdigest()))
        documents_in = int(np.count_nonzero(stream == EOS_ID))
        splits[name] = SplitIndex(documents=documents_in, tokens=len(stream), shards=tuple(shards))
    manifest = TokenManifest(
        dtype=dtype,
        tokenizer=TokenizerInfo(
            sha256=hashlib.sha256(tokenizer).hexdigest(), vocab_size=vocab_size, eos_token="<eos>", eos_id=EOS_ID
        ),
        validation_fraction=0.1,
        split_seed=0,
        splits=splits,
        inputs=("test-documents",),
    )
    assert storage.put_if_absent(MANIFEST_KEY, manifest.to_json()), "a corpus is already committed there"
    return Corpus(manifest=manifest, train=train.astype(np.int64), validation=validation.astype(np.int64))


def small_corpus(storage: StorageBackend, *, vocab_size: int = 256, seed: int = 0, shard_tokens: int = 1000) -> Corpus:
    """About 6,000 train and 600 validation tokens of learnable documents."""
    return write_corpus(
        storage,
        train=documents(90, vocab_size=vocab_size, seed=seed),
        validation=documents(9, vocab_size=vocab_size, seed=seed + 1),
        vocab_size=vocab_size,
        shard_tokens=shard_tokens,
    )
