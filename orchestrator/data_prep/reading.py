"""One read chunk -> its documents: the first stage Ray Data runs for ``meshpilot data prepare``.

Runs in Ray Data tasks (any node), through ``map_batches(read_documents, batch_size=1)``: one chunk
per call. A chunk is a byte range of a ``.jsonl`` file (the lines that *begin* inside it), a whole
``.txt`` file (one document), or a run of row groups of a ``.parquet`` file. Bytes come through
``checkpointing.storage`` (a directory or ``s3://``; credentials from the AWS chain of the node).

A mistake in the data (a line that is not JSON, a missing field, bytes that are not UTF-8) does
not raise here: the chunk ends with an *error row* (``error`` set, ``offset`` at the bad line's
first byte or the bad row), and the driver, which takes rows in input order, turns the first one it
meets into a message naming the file and line. So the error reported is the first in the input,
whichever task happened to finish first.

Why not ``ray.data.read_json``/``read_text``: they also read one whole file per task, but decode
leniently, name a block row rather than the file's line in their errors, and would need pyarrow's
own S3 credentials and endpoint beside ``checkpointing.storage``.
"""

from __future__ import annotations

import codecs
import functools
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from checkpointing.errors import CheckpointError
from checkpointing.storage import StorageBackend, open_storage
from workers.spec.tokens import CorpusFormat

# The columns of a documents batch; ``offset`` is -1 when an error has no place in the file.
DOCUMENT_COLUMNS = ("input", "offset", "span", "text", "error")
_PROBE_BYTES = 1 << 16  # how far past a chunk's end to look for the end of its last line, per read


@dataclass(frozen=True)
class ReadChunk:
    """What one task reads: ``[start, end)`` in bytes (txt, jsonl) or row groups (parquet) of one input.

    ``weight`` is the share of the input's bytes it stands for (the progress bar's unit).
    """

    input: int
    format: str
    root: str
    key: str
    size: int
    start: int
    end: int
    weight: int

    def to_row(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_batch(cls, batch: dict[str, np.ndarray], index: int) -> ReadChunk:
        return cls(
            input=int(batch["input"][index]),
            format=str(batch["format"][index]),
            root=str(batch["root"][index]),
            key=str(batch["key"][index]),
            size=int(batch["size"][index]),
            start=int(batch["start"][index]),
            end=int(batch["end"][index]),
            weight=int(batch["weight"][index]),
        )


@dataclass(frozen=True)
class RecordFields:
    """Which fields of a record make its document, per ``--format``, and the flag that names each.

    The document crosses to the tokenize stage as one string: the text itself (text), the JSON of
    the message list (chat: each message an object with a string ``role`` and a ``content``; keys
    holding null are dropped, as ``apply_chat_template`` drops them), or the JSON of ``[prompt,
    completion]`` (prompt-completion).
    """

    corpus_format: CorpusFormat
    names: tuple[str, ...]

    @property
    def flags(self) -> tuple[str, ...]:
        return _FLAGS[self.corpus_format]

    def document(self, record: dict[str, Any]) -> tuple[str, str]:
        """(document, "") or ("", why the record gives none, with the fix)."""
        for name, flag in zip(self.names, self.flags):
            if name not in record:
                fields = ", ".join(repr(key) for key in list(record)[:8]) or "none"
                what = flag.removeprefix("--").removesuffix("-field")
                return "", f"has no field {name!r} (its fields: {fields}); name the {what} field with {flag}"
        if self.corpus_format == CorpusFormat.CHAT:
            return _messages_json(record[self.names[0]], self.names[0])
        values = [record[name] for name in self.names]
        for name, value in zip(self.names, values):
            if not isinstance(value, str):
                return "", f"field {name!r} holds {_json_kind(value)}, not a string"
        return (values[0], "") if self.corpus_format == CorpusFormat.TEXT else (json.dumps(values), "")


_FLAGS = {
    CorpusFormat.TEXT: ("--text-field",),
    CorpusFormat.CHAT: ("--messages-field",),
    CorpusFormat.PROMPT_COMPLETION: ("--prompt-field", "--completion-field"),
}


def _messages_json(value: Any, name: str) -> tuple[str, str]:
    if not isinstance(value, list) or not value:
        kind = "an empty list" if isinstance(value, list) else _json_kind(value)
        return "", f'field {name!r} holds {kind}, not a list of messages ({{"role": ..., "content": ...}})'
    messages = []
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            return (
                "",
                f"message {number} of field {name!r} is {_json_kind(message)}, not an object with role and content",
            )
        message = {key: item for key, item in message.items() if item is not None}
        for key in ("role", "content"):
            if key not in message:
                return "", f"message {number} of field {name!r} has no {key!r}; each message needs a role and a content"
        if not isinstance(message["role"], str):
            return "", f"message {number} of field {name!r}: 'role' holds {_json_kind(message['role'])}, not a string"
        messages.append(message)
    return json.dumps(messages, ensure_ascii=False), ""


@functools.lru_cache(maxsize=16)
def open_input_storage(root: str, endpoint_url: str | None, region: str | None) -> StorageBackend:
    """The storage holding an input. A Ray worker process runs many chunks: one client per root."""
    return open_storage(root, endpoint_url=endpoint_url, region=region)


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one stored object, read by byte ranges (Parquet footers, row groups)."""

    def __init__(self, storage: StorageBackend, key: str, size: int) -> None:
        super().__init__()
        self.storage, self.key, self.size = storage, key, size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        end = min(self.size, self._position + len(buffer))
        if end <= self._position:
            return 0
        data = self.storage.get_range(self.key, self._position, end)
        memoryview(buffer).cast("B")[: len(data)] = data
        self._position += len(data)
        return len(data)


def read_documents(
    batch: dict[str, np.ndarray], *, fields: RecordFields, endpoint_url: str | None, region: str | None
) -> dict[str, np.ndarray]:
    """Ray Data stage: the chunks of ``batch`` -> their documents, in order (``DOCUMENT_COLUMNS``)."""
    inputs: list[int] = []
    offsets: list[int] = []
    spans: list[int] = []
    texts: list[str] = []
    errors: list[str] = []
    for index in range(len(batch["input"])):
        chunk = ReadChunk.from_batch(batch, index)
        found = _read_chunk(chunk, fields, endpoint_url, region)
        inputs += [chunk.input] * len(found)
        spans += spread(chunk.weight, len(found))
        for offset, text, error in found:
            offsets.append(offset)
            texts.append(text)
            errors.append(error)
    return {
        "input": np.asarray(inputs, dtype=np.int32),
        "offset": np.asarray(offsets, dtype=np.int64),
        "span": np.asarray(spans, dtype=np.int64),
        "text": _strings(texts),
        "error": _strings(errors),
    }


def _strings(values: list[str]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def spread(weight: int, count: int) -> list[int]:
    """``weight`` split over ``count`` parts as evenly as integers allow."""
    if count == 0:
        return []
    share, rest = divmod(weight, count)
    return [share] * (count - 1) + [share + rest]


Found = list[tuple[int, str, str]]  # (offset, text, error): documents in order, at most one error, last


def _read_chunk(chunk: ReadChunk, fields: RecordFields, endpoint_url: str | None, region: str | None) -> Found:
    try:
        storage = open_input_storage(chunk.root, endpoint_url, region)
        if chunk.format == "jsonl":
            return _jsonl(storage, chunk, fields)
        if chunk.format == "parquet":
            return _parquet(storage, chunk, fields)
        return _txt(storage, chunk)
    except CheckpointError as error:  # the storage refused or lost the input: reported like a bad line
        return [(-1, "", f"cannot be read: {error}")]


def owned_lines(
    read: Callable[[int, int], bytes], start: int, end: int, size: int, *, probe: int = _PROBE_BYTES
) -> tuple[int, bytes]:
    """The lines that begin in ``[start, end)`` of an object of ``size`` bytes: (first line's offset, bytes).

    A line begins at ``start`` only when the byte before it ends a line; the last line is read past
    ``end`` up to its newline (or the end of the object). So chunks cut anywhere cover every line once.
    """
    if start > 0:
        before = read(start - 1, end)
        newline = before.find(b"\n")
        if newline == -1 or start + newline >= end:
            return end, b""
        first, body = start + newline, bytearray(before[newline + 1 :])
    else:
        first, body = 0, bytearray(read(0, end))
    position = end
    while position < size and not body.endswith(b"\n"):
        piece = read(position, min(size, position + probe))
        newline = piece.find(b"\n")
        body += piece if newline == -1 else piece[: newline + 1]
        position += len(piece)
    return first, bytes(body)


def _jsonl(storage: StorageBackend, chunk: ReadChunk, fields: RecordFields) -> Found:
    first, body = owned_lines(
        lambda begin, stop: storage.get_range(chunk.key, begin, stop), chunk.start, chunk.end, chunk.size
    )
    found: Found = []
    offset = first
    for line in body.split(b"\n"):
        here, offset = offset, offset + len(line) + 1
        if here == 0 and line.startswith(codecs.BOM_UTF8):  # written by some editors; not part of the JSON
            line = line[len(codecs.BOM_UTF8) :]
        if not line.strip():
            continue
        text, error = json_document(line, fields)
        found.append((here, text, error))
        if error:
            break
    return found


def json_text(line: bytes, text_field: str) -> tuple[str, str]:
    """The text of one ``.jsonl`` line of a text corpus, or why the line cannot give one (with the fix)."""
    return json_document(line, RecordFields(CorpusFormat.TEXT, (text_field,)))


def json_document(line: bytes, fields: RecordFields) -> tuple[str, str]:
    """One ``.jsonl`` line -> its document (``RecordFields.document``), or why the line cannot give one."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return "", f"is not valid UTF-8 (byte 0x{line[error.start]:02x} at column {error.start + 1}); " + _REENCODE
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as error:
        return "", f"is not JSON ({error.msg} at column {error.colno}); fix the line or remove it"
    if not isinstance(record, dict):
        return "", f"is {_json_kind(record)}, not a JSON object with a {fields.names[0]!r} field"
    return fields.document(record)


def _json_kind(value: Any) -> str:
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


_REENCODE = "re-encode the file as UTF-8"


def _txt(storage: StorageBackend, chunk: ReadChunk) -> Found:
    data = storage.get(chunk.key)
    try:
        return [(0, data.decode("utf-8"), "")]
    except UnicodeDecodeError as error:
        return [(-1, "", f"is not valid UTF-8 (byte 0x{data[error.start]:02x} at byte {error.start}); " + _REENCODE)]


def _parquet(storage: StorageBackend, chunk: ReadChunk, fields: RecordFields) -> Found:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(RangeFile(storage, chunk.key, chunk.size))
        first_row = sum(parquet.metadata.row_group(group).num_rows for group in range(chunk.start))
        table = parquet.read_row_groups(list(range(chunk.start, chunk.end)), columns=list(fields.names))
        if fields.corpus_format == CorpusFormat.TEXT:
            # As bytes, decoded here: Parquet does not promise valid UTF-8, and the bad row is named.
            return _parquet_texts(table.column(0).cast(pa.large_binary()).to_pylist(), first_row, fields.names[0])
        records = table.to_pylist()
    except (pa.ArrowException, OSError) as error:
        return [(-1, "", f"is not a readable Parquet file ({error})")]
    found: Found = []
    for row, record in enumerate(records, start=first_row):
        document, problem = fields.document(record)
        found.append((row, document, problem))
        if problem:
            break
    return found


def _parquet_texts(values: list[bytes | None], first_row: int, text_field: str) -> Found:
    found: Found = []
    for row, value in enumerate(values, start=first_row):
        if value is None:
            found.append((row, "", f"has no text (field {text_field!r} is null); drop the row or fill it"))
            break
        try:
            found.append((row, value.decode("utf-8"), ""))
        except UnicodeDecodeError as error:
            found.append((row, "", f"is not valid UTF-8 (byte 0x{value[error.start]:02x}); " + _REENCODE))
            break
    return found
