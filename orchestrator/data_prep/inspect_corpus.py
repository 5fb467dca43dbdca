"""``meshpilot data inspect``: a corpus's summary, and one document with what trains marked (driver).

Runs on the driver, reading only what it shows: the manifest, then for document ``N`` of a split the
first ``4 (N + 1)`` bytes of ``{split}/documents.bin`` (the lengths before it give its offset in the
split's stream), then the byte ranges of the token shards and mask shards that hold it
(``StorageBackend.get_range``). Nothing else of the corpus is read, however large it is.

How a document is shown: runs of trained tokens as they decode, runs of *untrained* tokens (context:
prompts, system and user turns, template headers) between ``[[`` and ``]]`` in plain output, dim on a
terminal. Without ``--tokenizer`` the token ids are shown, marked the same way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import numpy as np

from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend, open_storage
from orchestrator.data_prep.reading import open_input_storage
from orchestrator.data_prep.tokenize import split_location
from orchestrator.errors import UserError
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    MANIFEST_KEY,
    TokenCorpusError,
    TokenManifest,
    documents_key,
    mask_key,
    parse_token_manifest,
    shard_ranges,
)

UNTRAINED_OPEN, UNTRAINED_CLOSE = "[[", "]]"  # around untrained spans in plain output


@dataclass(frozen=True)
class Document:
    """One document of a split: its place, its token ids, and a 0/1 per token (1: a trained target)."""

    split: str
    number: int
    start: int  # its first token's place in the split's stream
    tokens: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def trained(self) -> int:
        return sum(self.loss_mask)


def open_corpus(uri: str, *, endpoint_url: str | None, region: str | None) -> tuple[StorageBackend, TokenManifest]:
    """The storage and manifest of a committed corpus; ``UserError`` when there is none at ``uri``."""
    try:
        storage = open_storage(uri, endpoint_url=endpoint_url, region=region)
        if not storage.exists(MANIFEST_KEY):
            raise UserError(f"{uri} holds no token corpus (no {MANIFEST_KEY}); give an --out of meshpilot data prepare")
        return storage, parse_token_manifest(storage.get(MANIFEST_KEY), f"{uri}/{MANIFEST_KEY}")
    except (CheckpointError, TokenCorpusError) as error:
        raise UserError(str(error)) from None


def read_document(storage: StorageBackend, manifest: TokenManifest, split: str, number: int) -> Document:
    """Document ``number`` of ``split``, read by byte ranges; ``UserError`` for a number out of range."""
    index = manifest.splits[split]
    if not 0 <= number < index.documents:
        last = f"0 to {index.documents - 1}" if index.documents else "none"
        raise UserError(f"--document {number}: the {split} split holds {index.documents:,} documents ({last})")
    if index.documents_sha256 is None:
        raise UserError(
            f"{storage.uri} was prepared before document lengths were stored (corpus version {manifest.version}); "
            "prepare it again with meshpilot data prepare to inspect its documents"
        )
    width = np.dtype(DOCUMENT_LENGTH_DTYPE).itemsize
    lengths = np.frombuffer(storage.get_range(documents_key(split), 0, width * (number + 1)), DOCUMENT_LENGTH_DTYPE)
    start = int(lengths[:number].sum())
    stop = start + int(lengths[number])
    ranges = shard_ranges(index.shards, start, stop, manifest.itemsize)
    data = b"".join(storage.get_range(key, begin, end) for key, begin, end in ranges)
    tokens = np.frombuffer(data, dtype="<u2" if manifest.itemsize == 2 else "<u4").tolist()
    if manifest.loss_mask:
        mask_ranges = shard_ranges(index.shards, start, stop, 1)
        mask = list(b"".join(storage.get_range(mask_key(key), begin, end) for key, begin, end in mask_ranges))
    else:
        mask = [1] * len(tokens)
    return Document(split, number, start, tuple(tokens), tuple(mask))


def load_decoder(location: str, manifest: TokenManifest, *, endpoint_url: str | None, region: str | None) -> Any:
    """The ``tokenizers`` tokenizer at ``--tokenizer``; ``UserError`` unless it is the corpus's own (by sha256)."""
    from tokenizers import Tokenizer

    root, name = split_location(location)
    try:
        data = open_input_storage(root, endpoint_url, region).get(name)
    except CheckpointError as error:
        raise UserError(f"--tokenizer {location}: cannot read it ({error})") from None
    if hashlib.sha256(data).hexdigest() != manifest.tokenizer.sha256:
        raise UserError(
            f"--tokenizer {location} is not the tokenizer this corpus was prepared with (sha256 "
            f"{manifest.tokenizer.sha256[:12]}...); give that tokenizer.json, or leave --tokenizer out to see ids"
        )
    return Tokenizer.from_str(data.decode("utf-8"))


def marked_runs(document: Document, decoder: Any | None) -> list[tuple[bool, str]]:
    """(trained, text) for each run of tokens that train or not, decoded (or ids when ``decoder`` is None)."""
    runs = []
    position = 0
    for trained, run in groupby(document.loss_mask):
        length = len(list(run))
        ids = list(document.tokens[position : position + length])
        position += length
        if decoder is None:
            text = " ".join(map(str, ids))
        else:
            text = decoder.decode(ids, skip_special_tokens=False)
        runs.append((bool(trained), text))
    return runs


def plain_text(runs: list[tuple[bool, str]], *, separator: str = "") -> str:
    """The runs with each untrained one between ``[[`` and ``]]``."""
    return separator.join(text if trained else f"{UNTRAINED_OPEN}{text}{UNTRAINED_CLOSE}" for trained, text in runs)


def summary(manifest: TokenManifest) -> list[str]:
    """The manifest in a few lines: format, mask, tokenizer, and per split documents, tokens, trained tokens."""
    info = manifest.tokenizer
    mask = "loss mask stored" if manifest.loss_mask else "no loss mask: every token trains"
    lines = [
        f"format {manifest.corpus_format}, {mask}, version {manifest.version}",
        f"tokenizer sha256 {info.sha256[:12]}..., vocab {info.vocab_size:,}, eos {info.eos_token!r} = {info.eos_id}, "
        f"{manifest.dtype}",
    ]
    for name, split in manifest.splits.items():
        share = f" ({100 * split.trained / split.tokens:.1f}%)" if split.tokens else ""
        lines.append(
            f"{name:<10} {split.documents:>12,} documents {split.tokens:>14,} tokens "
            f"{split.trained:>14,} trained{share}"
        )
    return lines
