"""Token corpora for tests, written straight through the format module and checkpointing.storage.

    corpus = write_corpus(open_storage(uri), train=stream, validation=held_out, vocab_size=256)

The streams are what ``meshpilot data prepare`` would write for some documents (each followed by
its EOS): shards of ``shard_tokens`` tokens, each split's ``documents.bin`` (the documents'
lengths, cut after each EOS), with ``masks`` a mask shard beside every token shard, then the
manifest, last, as the commit.

    corpus = masked_corpus(open_storage(uri))   # a chat-like corpus: prompts masked, answers trained
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from checkpointing.storage import StorageBackend
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    MANIFEST_KEY,
    MASK_DTYPE,
    CorpusFormat,
    ShardEntry,
    SplitIndex,
    TokenizerInfo,
    TokenManifest,
    documents_key,
    mask_key,
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
    # 1 where a token trains, per split (every token when the corpus has no masks).
    train_mask: np.ndarray | None = None
    validation_mask: np.ndarray | None = None

    def document_lengths(self, split: str) -> np.ndarray:
        return document_lengths(self.train if split == "train" else self.validation)


def document_lengths(stream: np.ndarray) -> np.ndarray:
    """Each document's token count, EOS included (a stream's documents each end with EOS)."""
    ends = np.flatnonzero(stream == EOS_ID) + 1
    if len(ends) == 0 or ends[-1] != len(stream):
        ends = np.append(ends, len(stream))
    return np.diff(ends, prepend=0)


def prompt_masks(stream: np.ndarray, *, prompt_fraction: float = 0.5) -> np.ndarray:
    """A prompt-completion mask: the first ``prompt_fraction`` of each document is context (0),
    the rest of it and its EOS train (1)."""
    masks = []
    for length in document_lengths(stream):
        prompt = int(length * prompt_fraction)
        masks.append(np.r_[np.zeros(prompt, np.uint8), np.ones(length - prompt, np.uint8)])
    return np.concatenate(masks)


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
    masks: tuple[np.ndarray, np.ndarray] | None = None,
    corpus_format: CorpusFormat = CorpusFormat.TEXT,
) -> Corpus:
    """Shards (and mask shards: ``masks`` for train and validation) of both splits, their
    ``documents.bin``, then the manifest (put-if-absent: the commit)."""
    dtype = token_dtype(vocab_size)
    splits = {}
    for number_of_split, (name, stream) in enumerate((("train", train), ("validation", validation))):
        mask = None if masks is None else masks[number_of_split]
        shards = []
        for number, start in enumerate(range(0, len(stream), shard_tokens)):
            data = stream[start : start + shard_tokens].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
            key = shard_key(name, number)
            storage.put_bytes(key, data)
            mask_sha256 = None
            if mask is not None:
                mask_bytes = mask[start : start + shard_tokens].astype(MASK_DTYPE).tobytes()
                storage.put_bytes(mask_key(key), mask_bytes)
                mask_sha256 = hashlib.sha256(mask_bytes).hexdigest()
            tokens = len(data) // np.dtype(dtype).itemsize
            shards.append(ShardEntry(key, tokens, hashlib.sha256(data).hexdigest(), mask_sha256))
        lengths = document_lengths(stream).astype(DOCUMENT_LENGTH_DTYPE).tobytes()
        storage.put_bytes(documents_key(name), lengths)
        splits[name] = SplitIndex(
            documents=len(document_lengths(stream)),
            tokens=len(stream),
            shards=tuple(shards),
            trained_tokens=None if mask is None else int(mask.sum()),
            documents_sha256=hashlib.sha256(lengths).hexdigest(),
        )
    manifest = TokenManifest(
        dtype=dtype,
        tokenizer=TokenizerInfo(
            sha256=hashlib.sha256(tokenizer).hexdigest(), vocab_size=vocab_size, eos_token="<eos>", eos_id=EOS_ID
        ),
        validation_fraction=0.1,
        split_seed=0,
        splits=splits,
        inputs=("test-documents",),
        corpus_format=corpus_format,
        loss_mask=masks is not None,
    )
    assert storage.put_if_absent(MANIFEST_KEY, manifest.to_json()), "a corpus is already committed there"
    return Corpus(
        manifest=manifest,
        train=train.astype(np.int64),
        validation=validation.astype(np.int64),
        train_mask=None if masks is None else masks[0],
        validation_mask=None if masks is None else masks[1],
    )


def small_corpus(storage: StorageBackend, *, vocab_size: int = 256, seed: int = 0, shard_tokens: int = 1000) -> Corpus:
    """About 6,000 train and 600 validation tokens of learnable documents."""
    return write_corpus(
        storage,
        train=documents(90, vocab_size=vocab_size, seed=seed),
        validation=documents(9, vocab_size=vocab_size, seed=seed + 1),
        vocab_size=vocab_size,
        shard_tokens=shard_tokens,
    )


def masked_corpus(
    storage: StorageBackend, *, vocab_size: int = 256, seed: int = 0, shard_tokens: int = 1000, max_length: int = 120
) -> Corpus:
    """A prompt-completion corpus of about 90 train and 9 validation documents: the first half of
    each document is its prompt (masked), the rest its completion and EOS (trained)."""
    train = documents(90, vocab_size=vocab_size, seed=seed, max_length=max_length)
    validation = documents(9, vocab_size=vocab_size, seed=seed + 1, max_length=max_length)
    return write_corpus(
        storage,
        train=train,
        validation=validation,
        vocab_size=vocab_size,
        shard_tokens=shard_tokens,
        masks=(prompt_masks(train), prompt_masks(validation)),
        corpus_format=CorpusFormat.PROMPT_COMPLETION,
    )
