"""Token shards and the manifest: each split's stream cut into shards, uploaded, then the commit (driver).

Besides the token shards: a mask shard beside each (masked corpora; the same cut, a byte per token)
and each split's ``documents.bin`` (every document's length), all written and checked alike.

Runs on the driver, fed documents in input order. A split's shards hold exactly ``shard_tokens``
tokens each (the last fewer), cut from the split's stream wherever that falls, documents included:
the shard boundaries depend only on the tokens, never on how the work was parallelised. Uploads
run on background threads (``put_stream``: visible only once complete), at most ``max_pending`` at
a time so memory stays bounded, while the driver keeps taking documents.

The manifest is written last, with ``put_if_absent``: it is the commit, as for checkpoints
(``checkpointing/commit.py``). What a run does with ``--out``:

* no ``manifest.json``: a fresh corpus. Shards are written (over any left by an interrupted run);
  if the run fails before its commit, the shards it wrote are deleted again; after the commit,
  stray shards of an earlier, longer attempt are deleted.
* a manifest with the same tokenizer, dtype, split settings and inputs: the run *checks* it. Every
  shard must come out identical to the committed one (a missing one is written again, same bytes)
  and then the manifest must be byte-identical; nothing committed is ever rewritten.
* a manifest with other settings or inputs, or one the inputs no longer reproduce: refused. Shard
  names are fixed by the format, so a corpus cannot be replaced in place without a window in which
  its manifest points at other bytes; the user chooses another ``--out`` or deletes the old one.
"""

from __future__ import annotations

import hashlib
import logging
import re
from array import array
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from checkpointing.storage import StorageBackend
from orchestrator.errors import UserError
from workers.spec.tokens import (
    DOCUMENT_LENGTH_DTYPE,
    MANIFEST_KEY,
    SPLITS,
    VERSION,
    ShardEntry,
    SplitIndex,
    TokenCorpusError,
    TokenManifest,
    documents_key,
    mask_key,
    parse_token_manifest,
    shard_key,
)

log = logging.getLogger("meshpilot")
_SHARD_KEY = re.compile(r"^(train|validation)/\d{5}\.(bin|mask)$")
_SETTINGS = (
    "tokenizer",
    "dtype",
    "validation_fraction",
    "split_seed",
    "inputs",
    "corpus_format",
    "loss_mask",
    "fields",
    "chat_template_sha256",
)


class ShardUploader:
    """Uploads (or, against a committed corpus, checks) shards, masks and document lengths on background threads."""

    def __init__(self, storage: StorageBackend, *, committed: TokenManifest | None, max_pending: int = 2) -> None:
        self.storage = storage
        self.written: list[str] = []  # keys this run created: deleted again if it fails before its commit
        self.kept = 0  # committed objects found intact
        self.repaired = 0  # committed objects that were missing, written again with the same bytes
        self._committed = committed_objects(committed) if committed else None
        self._stored = {info.key: info.size for info in storage.list()} if committed else {}
        self._pool = ThreadPoolExecutor(max_workers=max_pending, thread_name_prefix="shard-upload")
        self._pending: deque[Future] = deque()
        self._max_pending = max_pending

    def submit(self, key: str, data: bytes) -> Future[str]:
        """Store ``data`` under ``key`` in the background; the future gives its sha256."""
        while len(self._pending) >= self._max_pending:  # back-pressure: at most this many shards in memory
            self._pending.popleft().result()
        future = self._pool.submit(self._store, key, data)
        self._pending.append(future)
        return future

    def _store(self, key: str, data: bytes) -> str:
        sha256 = hashlib.sha256(data).hexdigest()
        if self._committed is None:
            self.storage.put_stream(key, [data], size=len(data))
            self.written.append(key)
            return sha256
        if self._committed.get(key) != sha256:
            raise UserError(
                f"{self.storage.uri} holds a corpus of these inputs and settings, but its {key} differs from "
                "what they give now (the inputs changed since); prepare into another --out, or delete the old corpus"
            )
        if self._stored.get(key) == len(data):
            self.kept += 1
        else:  # the committed bytes are gone: write them again, identical
            self.storage.put_stream(key, [data], size=len(data))
            self.repaired += 1
        return sha256

    def discard_written(self) -> None:
        """After a failure before the commit: wait for the uploads, then delete what this run wrote."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.written:
            self.storage.delete(list(self.written))
            log.info("removed %d shard(s) of the failed run from %s", len(self.written), self.storage.uri)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def committed_objects(manifest: TokenManifest) -> dict[str, str]:
    """Every object a committed corpus lists (shards, mask shards, document lengths) -> its sha256."""
    objects = {}
    for name, split in manifest.splits.items():
        for shard in split.shards:
            objects[shard.key] = shard.sha256
            if shard.mask_sha256 is not None:
                objects[mask_key(shard.key)] = shard.mask_sha256
        if split.documents_sha256 is not None:
            objects[documents_key(name)] = split.documents_sha256
    return objects


@dataclass
class _PendingShard:
    key: str
    tokens: int
    sha256: Future[str]
    mask_sha256: Future[str] | None

    def entry(self) -> ShardEntry:
        mask = self.mask_sha256.result() if self.mask_sha256 is not None else None
        return ShardEntry(key=self.key, tokens=self.tokens, sha256=self.sha256.result(), mask_sha256=mask)


class SplitWriter:
    """One split's token stream (and mask stream) cut into shards of ``shard_tokens`` tokens as documents arrive."""

    def __init__(
        self, split: str, uploader: ShardUploader, *, itemsize: int, shard_tokens: int, masked: bool = False
    ) -> None:
        self.split = split
        self.documents = 0
        self.tokens = 0
        self.trained_tokens = 0
        self.masked = masked
        self._uploader = uploader
        self.itemsize = itemsize
        self._shard_tokens = shard_tokens
        self._buffer = bytearray()
        self._mask_buffer = bytearray()
        self._lengths = array("I")  # each document's token count: 4 bytes a document on the driver
        self._shards: list[_PendingShard] = []

    def append(self, document_tokens: bytes, mask: bytes | None = None) -> None:
        """One document's tokens (its EOS included) as shard bytes, and (masked) its mask, a byte per token."""
        count = len(document_tokens) // self.itemsize
        self.documents += 1
        self.tokens += count
        self._lengths.append(count)
        self._buffer += document_tokens
        if self.masked:
            assert mask is not None and len(mask) == count, "a masked corpus has a mask byte per token"
            self.trained_tokens += count - mask.count(0)
            self._mask_buffer += mask
        else:
            self.trained_tokens += count
        while len(self._buffer) >= self._shard_tokens * self.itemsize:
            self._cut(self._shard_tokens)

    def _cut(self, tokens: int) -> None:
        size = tokens * self.itemsize
        with memoryview(self._buffer) as whole, whole[:size] as head:  # one copy of the shard, not two
            data = bytes(head)
        del self._buffer[:size]
        key = shard_key(self.split, len(self._shards))
        mask_sha256 = None
        if self.masked:
            mask = bytes(self._mask_buffer[:tokens])
            del self._mask_buffer[:tokens]
            mask_sha256 = self._uploader.submit(mask_key(key), mask)
        self._shards.append(_PendingShard(key, tokens, self._uploader.submit(key, data), mask_sha256))

    def finish(self) -> SplitIndex:
        """Upload the last, shorter shard and the document lengths; wait for every upload; the split's index."""
        if self._buffer:
            self._cut(len(self._buffer) // self.itemsize)
        lengths = np.asarray(self._lengths, dtype=DOCUMENT_LENGTH_DTYPE).tobytes()
        documents_sha256 = self._uploader.submit(documents_key(self.split), lengths)
        shards = tuple(shard.entry() for shard in self._shards)
        return SplitIndex(
            documents=self.documents,
            tokens=self.tokens,
            shards=shards,
            trained_tokens=self.trained_tokens,
            documents_sha256=documents_sha256.result(),
        )


def committed_manifest(storage: StorageBackend) -> TokenManifest | None:
    """The corpus already committed under ``storage``, if any."""
    if not storage.exists(MANIFEST_KEY):
        return None
    where = f"{storage.uri}/{MANIFEST_KEY}"
    try:
        return parse_token_manifest(storage.get(MANIFEST_KEY), where)
    except TokenCorpusError as error:
        raise UserError(f"{error}; --out must be a new location or a corpus meshpilot data prepare wrote") from None


def refuse_other_corpus(existing: TokenManifest, draft: TokenManifest, uri: str) -> None:
    """``UserError`` when the committed corpus was prepared with other settings or inputs than ``draft``."""
    if existing.version != VERSION:
        raise UserError(
            f"{uri} holds a token corpus of version {existing.version} (an earlier meshpilot): it still trains as it "
            f"is; to prepare it again as version {VERSION}, give another --out"
        )
    differences = [name.replace("_", " ") for name in _SETTINGS if getattr(existing, name) != getattr(draft, name)]
    if differences:
        raise UserError(
            f"{uri} already holds a token corpus prepared with other settings ({', '.join(differences)} differ); "
            "a committed corpus is never rewritten in place: give another --out, or delete the old corpus first"
        )


def commit_manifest(storage: StorageBackend, manifest: TokenManifest) -> bool:
    """Write the manifest unless one exists: True when this call committed, False when it was already identical."""
    data = manifest.to_json()
    if storage.put_if_absent(MANIFEST_KEY, data):
        return True
    if storage.get(MANIFEST_KEY) == data:
        return False
    raise UserError(
        f"{storage.uri} was committed meanwhile with another corpus (another run writes to the same --out, "
        "or the inputs changed); give another --out"
    )


def remove_strays(storage: StorageBackend, manifest: TokenManifest) -> int:
    """Delete shards and mask shards that the committed manifest does not list (left by an earlier, failed attempt)."""
    listed = set(committed_objects(manifest))
    strays = [
        info.key
        for split in SPLITS
        for info in storage.list(f"{split}/")
        if _SHARD_KEY.match(info.key) and info.key not in listed
    ]
    if strays:
        storage.delete(strays)
    return len(strays)


def with_splits(draft: TokenManifest, writers: dict[str, SplitWriter]) -> TokenManifest:
    """The manifest: ``draft`` (settings and inputs) with every split's finished index."""
    return replace(draft, splits={split: writers[split].finish() for split in SPLITS})
