"""``LocalStorage``: the storage protocol on a local (or network-mounted) filesystem.

Runs wherever a ``file://`` URI or a directory path is given (ranks, driver, CLI). An object
is written to a hidden ``.NAME.UPLOADID.partial`` file beside its final path, fsynced, then
renamed into place, so readers never see half an object; a writer killed halfway leaves only
the ``.partial`` file, which ``list_pending_uploads`` reports and retention aborts.
``put_if_absent`` links the finished temporary file to the final name: ``link(2)`` fails when
the name exists, which makes it the atomic, no-replace commit.
"""

from __future__ import annotations

import builtins  # in the class body below, `list` is the method: later annotations say builtins.list
import errno
import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path

from checkpointing.errors import CheckpointError, StorageAccessError, StorageCredentialsError
from checkpointing.storage import DEFAULT_PART_SIZE, Buffer, ObjectInfo, PendingUpload

_PARTIAL = re.compile(r"^\.(?P<name>.+)\.(?P<upload_id>[0-9a-f]{32})\.partial$")


class LocalStorage:
    """Objects as files under one root directory; keys are ``/``-separated relative paths."""

    def __init__(self, root: str | os.PathLike, *, part_size: int = DEFAULT_PART_SIZE, fsync: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)
        self.part_size = part_size
        self._fsync = fsync

    # ------------------------------------------------------------------ paths
    def _path(self, key: str) -> Path:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise CheckpointError(f"invalid object key {key!r}")
        return self.root.joinpath(*parts)

    def _key(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def _temporary(self, path: Path) -> Path:
        return path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")

    # ----------------------------------------------------------------- writes
    def put_stream(self, key: str, pieces: Iterable[Buffer], *, size: int | None = None) -> int:
        path = self._path(key)
        temporary = self._write_temporary(path, pieces)
        try:
            os.replace(temporary, path)
        except OSError as error:
            _unlink_quietly(temporary)
            raise self._access_error(error, key) from None
        self._sync_directory(path.parent)
        return path.stat().st_size

    def put_bytes(self, key: str, data: Buffer) -> None:
        self.put_stream(key, [data])

    def put_if_absent(self, key: str, data: Buffer) -> bool:
        path = self._path(key)
        temporary = self._write_temporary(path, [data])
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        except OSError as error:
            raise self._access_error(error, key) from None
        finally:
            _unlink_quietly(temporary)
        self._sync_directory(path.parent)
        return True

    def _write_temporary(self, path: Path, pieces: Iterable[Buffer]) -> Path:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise self._access_error(error, self._key(path)) from None
        temporary = self._temporary(path)
        try:
            with open(temporary, "wb", buffering=0) as handle:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while view:
                        written = handle.write(view)
                        view = view[written:]
                if self._fsync:
                    os.fsync(handle.fileno())
        except BaseException as error:
            _unlink_quietly(temporary)
            if isinstance(error, OSError):
                raise self._access_error(error, self._key(path)) from None
            raise
        return temporary

    def _sync_directory(self, directory: Path) -> None:
        if not self._fsync:
            return
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    # ------------------------------------------------------------------ reads
    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise CheckpointError(f"invalid byte range [{start}, {end}) of {key!r}")
        try:
            with open(self._path(key), "rb", buffering=0) as handle:
                data = os.pread(handle.fileno(), end - start, start)
        except OSError as error:
            raise self._access_error(error, key) from None
        if len(data) != end - start:
            from checkpointing.errors import CorruptCheckpointError

            raise CorruptCheckpointError(
                f"object {key!r} is shorter than expected: asked for bytes [{start}, {end}), got {len(data)}", key=key
            )
        return data

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as error:
            raise self._access_error(error, key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        found = []
        for path in self._walk():
            key = self._key(path)
            if key.startswith(prefix) and not _PARTIAL.match(path.name):
                found.append(ObjectInfo(key=key, size=path.stat().st_size))
        return sorted(found, key=lambda info: info.key)

    def _walk(self) -> builtins.list[Path]:
        if not self.root.is_dir():
            return []
        found: builtins.list[Path] = []
        for directory, _, names in os.walk(self.root):
            found.extend(Path(directory, name) for name in names)
        return found

    # --------------------------------------------------------------- deletion
    def delete(self, keys: Iterable[str]) -> None:
        directories = set()
        for key in keys:
            path = self._path(key)
            _unlink_quietly(path)
            directories.add(path.parent)
        for directory in sorted(directories, key=lambda d: len(d.parts), reverse=True):
            while directory != self.root and directory.is_relative_to(self.root):
                try:
                    directory.rmdir()  # only when empty: a step directory goes with its last file
                except OSError:
                    break
                directory = directory.parent

    def list_pending_uploads(self, prefix: str = "") -> builtins.list[PendingUpload]:
        pending = []
        for path in self._walk():
            match = _PARTIAL.match(path.name)
            if not match:
                continue
            key = self._key(path.with_name(match["name"]))
            if key.startswith(prefix):
                pending.append(PendingUpload(key=key, upload_id=match["upload_id"], initiated=path.stat().st_mtime))
        return sorted(pending, key=lambda upload: (upload.key, upload.initiated))

    def abort_pending_upload(self, upload: PendingUpload) -> None:
        path = self._path(upload.key)
        _unlink_quietly(path.with_name(f".{path.name}.{upload.upload_id}.partial"))

    # ------------------------------------------------------------------ misc
    def check_access(self) -> None:
        probe = self.root if self.root.exists() else next((p for p in self.root.parents if p.exists()), None)
        if probe is None or not probe.is_dir():
            raise StorageAccessError(f"checkpoint directory {self.uri} cannot be created: {probe} is not a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise StorageCredentialsError(
                f"checkpoint directory {self.uri}: no write permission on {probe}; choose a writable checkpoint.uri"
            )

    def close(self) -> None:
        pass

    def _access_error(self, error: OSError, key: str) -> CheckpointError:
        where = f"{self.uri}/{key}"
        if error.errno in (errno.EACCES, errno.EPERM):
            return StorageCredentialsError(f"permission denied on {where}; choose a writable checkpoint.uri")
        if error.errno == errno.ENOENT:
            from checkpointing.errors import CheckpointNotFoundError

            return CheckpointNotFoundError(f"no object {where}")
        if error.errno == errno.ENOSPC:
            return StorageAccessError(f"no space left on the device holding {self.uri}")
        return StorageAccessError(f"cannot access {where}: {error.strerror}")

    def __repr__(self) -> str:
        return f"LocalStorage({self.uri!r})"


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
