"""The ``StorageBackend`` protocol and ``open_storage(uri)``: where checkpoint bytes live.

Used on the ranks (the writer streams shard files, the reader fetches byte ranges) and on the
driver (the coordinator commits manifests, retention deletes, the CLI lists). Keys are relative
to the URI's root (``s3://bucket/prefix`` or a directory), so a checkpoint tree can be copied
elsewhere and still read. Two implementations: ``checkpointing.s3.S3Storage`` and
``checkpointing.local.LocalStorage``; both pass ``tests/unit/test_ckpt_storage.py``.

Semantics every backend keeps:

* ``put_stream`` makes the object visible only once every byte is durable (S3 multipart
  complete; atomic rename on disk). A writer killed halfway leaves a *pending upload*, never a
  partial object; ``list_pending_uploads`` / ``abort_pending_upload`` clean those up.
* ``put_if_absent`` is the commit: it writes the object only if no object has the key, and says
  whether it did. It is atomic (``IfNoneMatch="*"`` on S3, ``link(2)`` on disk).
"""

from __future__ import annotations

import builtins  # in the class body below, `list` is the method: later annotations say builtins.list
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urlparse

from checkpointing.errors import CheckpointError

Buffer = bytes | bytearray | memoryview

DEFAULT_PART_SIZE = 8 << 20
DEFAULT_CONCURRENCY = 4


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: key relative to the root, size in bytes."""

    key: str
    size: int


@dataclass(frozen=True)
class PendingUpload:
    """An upload that was started and neither completed nor aborted (e.g. its writer died)."""

    key: str
    upload_id: str
    initiated: float  # seconds since the epoch


class RangeSource(Protocol):
    """What a restore reads from: byte ranges of named objects (storage, or peer memory)."""

    uri: str

    def get_range(self, key: str, start: int, end: int) -> bytes: ...


@runtime_checkable
class StorageBackend(Protocol):
    """Object storage as the checkpoint code sees it. Every method is safe to call from threads."""

    uri: str
    part_size: int

    def put_stream(self, key: str, pieces: Iterable[Buffer], *, size: int | None = None) -> int:
        """Store the concatenation of ``pieces`` (multipart, no temporary file); return its size."""

    def put_bytes(self, key: str, data: Buffer) -> None:
        """Store a small object in one request (overwrites)."""

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        """Atomically store ``data`` unless ``key`` exists; True when this call created it."""

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object."""

    def get(self, key: str) -> bytes:
        """A whole object."""

    def exists(self, key: str) -> bool:
        """Whether a (complete) object has this key."""

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every complete object whose key starts with ``prefix``, sorted by key."""

    def delete(self, keys: Iterable[str]) -> None:
        """Remove objects; keys that do not exist are ignored."""

    def list_pending_uploads(self, prefix: str = "") -> builtins.list[PendingUpload]:
        """Uploads started under ``prefix`` and never completed nor aborted."""

    def abort_pending_upload(self, upload: PendingUpload) -> None:
        """Throw away the parts of an unfinished upload."""

    def check_access(self) -> None:
        """Raise a ``StorageAccessError`` naming the problem when the root cannot be used."""

    def close(self) -> None:
        """Release connections and threads."""


def split_parts(pieces: Iterable[Buffer], part_size: int) -> Iterator[memoryview]:
    """Regroup ``pieces`` into parts of exactly ``part_size`` bytes (the last may be shorter).

    Large pieces are sliced without copying; only parts that straddle two pieces are joined,
    so a writer that hands over one big memoryview uploads straight from its host buffer.
    """
    pending = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if pending:
            take = min(part_size - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) < part_size:
                continue
            yield memoryview(bytes(pending))
            pending = bytearray()
        whole = len(view) - len(view) % part_size
        for start in range(0, whole, part_size):
            yield view[start : start + part_size]
        pending += view[whole:]
    if pending:
        yield memoryview(bytes(pending))


def open_storage(
    uri: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    part_size: int = DEFAULT_PART_SIZE,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> StorageBackend:
    """The backend for ``uri``: ``s3://bucket/prefix``, ``file:///dir`` or a plain directory path.

    S3 credentials come from the standard AWS chain only (environment, profile, instance role);
    they are never arguments, so they never reach a config file, an event or a log line.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise CheckpointError("checkpoint URI is empty: give s3://bucket/prefix, file:///dir or a directory")
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme == "s3":
        from checkpointing.s3 import S3Storage

        if not parsed.netloc:
            raise CheckpointError(f"checkpoint URI {uri!r} names no bucket: write s3://BUCKET/prefix")
        return S3Storage(
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            endpoint_url=endpoint_url,
            region=region,
            part_size=part_size,
            concurrency=concurrency,
        )
    if scheme == "file" or scheme == "" or (len(scheme) == 1 and uri[1:3] in (":\\", ":/")):
        from checkpointing.local import LocalStorage

        path = parsed.path if scheme == "file" else uri
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise CheckpointError(f"checkpoint URI {uri!r}: file URIs take an absolute path, e.g. file:///data/ckpt")
        return LocalStorage(path, part_size=part_size)
    raise CheckpointError(
        f"checkpoint URI {uri!r}: unsupported scheme {scheme!r}; use s3://bucket/prefix, file:///dir or a directory"
    )
