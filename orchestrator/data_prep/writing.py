"""Shard plans, the shard outcomes, and the manifest: the driver's side of writing a corpus (driver).

Runs on the driver, fed each document's place in a piece (``pieces.write_pieces``) in input order. A
split's shards hold exactly ``shard_tokens`` tokens each (the last fewer), cut from the split's stream
wherever that falls, documents included: the shard boundaries depend only on the tokens, never on how
the work was parallelised. ``SplitPlan`` turns the documents into shard plans (lists of piece ranges);
``pieces.assemble_shards`` builds and stores them in Ray Data tasks. The driver itself writes only each
split's ``documents.bin`` (every document's length: 4 bytes a document) and the manifest. A masked
corpus has a mask shard beside each token shard, cut at the same places.

The manifest is written last, with ``put_if_absent``: it is the commit, as for checkpoints
(``checkpointing/commit.py``). What a run does with ``--out``:

* no ``manifest.json``: a fresh corpus. Shards are written (over any left by an interrupted run);
  if the run fails before its commit, the shards it planned are deleted again; after the commit,
  stray shards of an earlier, longer attempt, and pieces of a killed one, are deleted.
* a manifest with the same tokenizer, dtype, split settings, inputs, format and fields: the run
  *checks* it. Every shard must come out identical to the committed one (a missing one is written
  again, same bytes) and then the manifest must be byte-identical; nothing committed is ever rewritten.
* a manifest with other settings or inputs, or one the inputs no longer reproduce: refused. Shard
  names are fixed by the format, so a corpus cannot be replaced in place without a window in which
  its manifest points at other bytes; the user chooses another ``--out`` or deletes the old one.
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkpointing.storage import StorageBackend
from orchestrator.data_prep.pieces import PIECES_PREFIX, Stored, store
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


@dataclass(frozen=True)
class ShardPlan:
    """One shard to build: its key, its token count, and the piece ranges [start, stop) (in tokens) it joins."""

    key: str
    tokens: int
    segments: tuple[tuple[str, int, int], ...]

    def to_row(self, committed: dict[str, str] | None, stored: dict[str, int]) -> dict[str, Any]:
        """The row ``pieces.assemble_shards`` takes: with the committed sha256s and stored sizes to check against."""
        masks = mask_key(self.key)
        checking = committed is not None  # against a committed corpus: a key it does not list differs
        committed = {} if committed is None else committed
        return {
            "key": self.key,
            "segments": json.dumps(self.segments),
            "checking": checking,
            "expected": committed.get(self.key, ""),
            "stored_size": stored.get(self.key, -1),
            "expected_mask": committed.get(masks, ""),
            "stored_mask_size": stored.get(masks, -1),
        }


@dataclass
class SplitPlan:
    """One split's documents, in order, planned into shards of ``shard_tokens`` tokens."""

    split: str
    shard_tokens: int
    documents: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    shards: list[ShardPlan] = field(default_factory=list)
    lengths: array = field(default_factory=lambda: array("I"))  # each document's token count, in order
    _segments: list[list[Any]] = field(default_factory=list)  # of the shard being filled: [piece, start, stop]
    _filled: int = 0

    def append(self, piece: str, position: int, length: int, trained: int) -> None:
        """The split's next document: ``length`` tokens at ``position`` of ``piece``, ``trained`` of them trained."""
        self.documents += 1
        self.tokens += length
        self.trained_tokens += trained
        self.lengths.append(length)
        while length > 0:
            take = min(length, self.shard_tokens - self._filled)
            last = self._segments[-1] if self._segments else None
            if last is not None and last[0] == piece and last[2] == position:
                last[2] += take  # the next document of the same piece: one range, one read
            else:
                self._segments.append([piece, position, position + take])
            position, length, self._filled = position + take, length - take, self._filled + take
            if self._filled == self.shard_tokens:
                self._close()

    def finish(self) -> list[ShardPlan]:
        if self._filled:
            self._close()
        return self.shards

    def _close(self) -> None:
        segments = tuple((str(piece), int(start), int(stop)) for piece, start, stop in self._segments)
        self.shards.append(ShardPlan(shard_key(self.split, len(self.shards)), self._filled, segments))
        self._segments, self._filled = [], 0

    def document_lengths(self) -> bytes:
        return np.asarray(self.lengths, dtype=DOCUMENT_LENGTH_DTYPE).tobytes()


@dataclass(frozen=True)
class ShardOutcome:
    """What ``pieces.assemble_shards`` did with one shard."""

    sha256: str
    mask_sha256: str | None
    stored: Stored


def split_index(
    plan: SplitPlan, outcomes: dict[str, ShardOutcome], documents_sha256: str, *, masked: bool
) -> SplitIndex:
    """The manifest's entry for a split, from its plan and what the tasks stored."""
    shards = tuple(
        ShardEntry(
            key=shard.key,
            tokens=shard.tokens,
            sha256=outcomes[shard.key].sha256,
            mask_sha256=outcomes[shard.key].mask_sha256 if masked else None,
        )
        for shard in plan.shards
    )
    return SplitIndex(
        documents=plan.documents,
        tokens=plan.tokens,
        shards=shards,
        trained_tokens=plan.trained_tokens,
        documents_sha256=documents_sha256,
    )


def store_document_lengths(
    storage: StorageBackend, plan: SplitPlan, committed: dict[str, str] | None, stored: dict[str, int]
) -> tuple[str, Stored]:
    """Write (or check) a split's ``documents.bin`` from the driver: 4 bytes a document, no tokens."""
    key = documents_key(plan.split)
    expected = None if committed is None else committed.get(key, "")
    return store(storage, key, plan.document_lengths(), expected=expected, stored_size=stored.get(key, -1))


def planned_keys(plans: dict[str, SplitPlan]) -> list[str]:
    """Every object a run's plans would write: deleted again when a fresh run fails before its commit."""
    keys = [documents_key(split) for split in plans]
    for plan in plans.values():
        for shard in plan.shards:
            keys += [shard.key, mask_key(shard.key)]
    return keys


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


def refuse_changed_inputs(uri: str, key: str) -> UserError:
    return UserError(
        f"{uri} holds a corpus of these inputs and settings, but its {key} differs from what they give now "
        "(the inputs changed since); prepare into another --out, or delete the old corpus"
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
    strays += [info.key for info in storage.list(PIECES_PREFIX)]  # of a killed run
    if strays:
        storage.delete(strays)
    return len(strays)
