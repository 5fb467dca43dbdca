"""``--input`` patterns -> the ordered input files, and the chunks Ray Data reads them in (driver).

Runs on the driver, before any Ray work. Inputs keep the order they were given in; the files one
glob matches are sorted by name; a file matched twice counts once. That order numbers the inputs
(``input_number`` in ``workers.spec.tokens.is_validation``), so the same command line on the same
files always gives the same split and the same shards. Local paths are recorded absolute; on a
remote cluster they must be visible to every node (a shared filesystem), else use ``s3://``.

    files = resolve_inputs(["corpus/*.jsonl", "s3://bucket/web/part-*.parquet"], endpoint_url=None, region=None)
    fields = RecordFields(CorpusFormat.TEXT, ("text",))
    chunks = plan_chunks(files, fields=fields, chunk_bytes=DEFAULT_CHUNK_BYTES, endpoint_url=None, region=None)

Globs: ``*``, ``?`` and ``[...]`` stay within one ``/`` level, ``**`` crosses levels (on S3 as on disk).
"""

from __future__ import annotations

import fnmatch
import glob
import os
from dataclasses import dataclass
from urllib.parse import urlparse

from checkpointing.errors import CheckpointError
from orchestrator.data_prep.reading import RangeFile, ReadChunk, RecordFields, open_input_storage, spread
from orchestrator.errors import UserError
from workers.spec.tokens import CorpusFormat

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
DEFAULT_CHUNK_BYTES = 4 << 20  # one task's share of a .jsonl file or of a .parquet file's row groups
_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary")
_COUNT_BYTES = 8 << 20  # read size while counting lines for an error message


@dataclass(frozen=True)
class InputFile:
    """One input, numbered in input order; ``root`` + ``key`` locate it through ``checkpointing.storage``."""

    number: int
    uri: str
    root: str
    key: str
    size: int
    format: str


def resolve_inputs(patterns: list[str], *, endpoint_url: str | None, region: str | None) -> list[InputFile]:
    """Every file the patterns name, in order; ``UserError`` for a missing file, empty glob or empty file."""
    seen: dict[str, tuple[str, str, int]] = {}
    for pattern in patterns:
        if pattern.startswith("s3://"):
            matches = _s3_matches(pattern, endpoint_url, region)
        else:
            matches = _local_matches(pattern)
        for uri, root, key, size in matches:
            seen.setdefault(uri, (root, key, size))
    files = []
    for number, (uri, (root, key, size)) in enumerate(seen.items()):
        suffix = os.path.splitext(key)[1].lower()
        if suffix not in FORMATS:
            raise UserError(
                f"input {uri}: unsupported file type {suffix or '(none)'!r}; give .txt (one document per file), "
                ".jsonl (one JSON object per line) or .parquet files"
            )
        if size == 0:
            raise UserError(f"input {uri} is empty (0 bytes); remove it from --input")
        files.append(InputFile(number=number, uri=uri, root=root, key=key, size=size, format=FORMATS[suffix]))
    return files


def _has_magic(pattern: str) -> bool:
    return any(character in pattern for character in "*?[")


def _local_matches(pattern: str) -> list[tuple[str, str, str, int]]:
    path = os.path.expanduser(pattern)
    if _has_magic(path):
        found = sorted(match for match in glob.glob(path, recursive=True) if os.path.isfile(match))
        if not found:
            raise UserError(f"--input {pattern!r} matches no file; check the pattern (quote it so the shell keeps it)")
    elif os.path.isdir(path):
        raise UserError(f"--input {pattern} is a directory; give its files or a glob such as {pattern}/*.jsonl")
    elif not os.path.isfile(path):
        raise UserError(f"--input {pattern}: no such file")
    else:
        found = [path]
    matches = []
    for match in found:
        absolute = os.path.abspath(match)
        matches.append((absolute, os.path.dirname(absolute), os.path.basename(absolute), os.path.getsize(absolute)))
    return matches


def _s3_matches(pattern: str, endpoint_url: str | None, region: str | None) -> list[tuple[str, str, str, int]]:
    parsed = urlparse(pattern)
    path = parsed.path.lstrip("/")
    if not parsed.netloc or not path:
        raise UserError(f"--input {pattern!r}: write s3://BUCKET/KEY or s3://BUCKET/PREFIX/*.jsonl")
    root = f"s3://{parsed.netloc}"
    storage = open_input_storage(root, endpoint_url, region)
    if _has_magic(path):
        literal = path[: min(path.index(c) for c in "*?[" if c in path)]
        keys = [(info.key, info.size) for info in storage.list(literal) if _glob_match(info.key, path)]
        if not keys:
            raise UserError(f"--input {pattern!r} matches no object; check the pattern and --endpoint-url")
    else:
        keys = [(info.key, info.size) for info in storage.list(path) if info.key == path]
        if not keys:
            raise UserError(f"--input {pattern}: no such object")
    return [(f"{root}/{key}", root, key, size) for key, size in sorted(keys)]


def _glob_match(key: str, pattern: str) -> bool:
    # fnmatch's ``*`` also crosses ``/``; keep globs to one level unless they say ``**``, as on disk.
    return fnmatch.fnmatchcase(key, pattern) and ("**" in pattern or key.count("/") == pattern.count("/"))


def plan_chunks(
    files: list[InputFile], *, fields: RecordFields, chunk_bytes: int, endpoint_url: str | None, region: str | None
) -> list[ReadChunk]:
    """The read tasks, in input order: byte ranges of ``.jsonl``, whole ``.txt``, runs of Parquet row groups."""
    chunks: list[ReadChunk] = []
    for file in files:
        if file.format == "txt" and fields.corpus_format != CorpusFormat.TEXT:
            raise UserError(
                f"input {file.uri}: --format {fields.corpus_format} reads records from .jsonl or .parquet files, "
                "not .txt; give those, or --format text"
            )
        if file.format == "txt":
            chunks.append(_chunk(file, 0, file.size, file.size))
        elif file.format == "jsonl":
            for start in range(0, file.size, chunk_bytes):
                end = min(file.size, start + chunk_bytes)
                chunks.append(_chunk(file, start, end, end - start))
        else:
            groups = _row_group_runs(file, fields, chunk_bytes, endpoint_url, region)
            weights = spread(file.size, len(groups))
            chunks += [_chunk(file, start, end, weight) for (start, end), weight in zip(groups, weights)]
    return chunks


def _chunk(file: InputFile, start: int, end: int, weight: int) -> ReadChunk:
    return ReadChunk(
        input=file.number,
        format=file.format,
        root=file.root,
        key=file.key,
        size=file.size,
        start=start,
        end=end,
        weight=weight,
    )


def _row_group_runs(
    file: InputFile, fields: RecordFields, chunk_bytes: int, endpoint_url: str | None, region: str | None
) -> list[tuple[int, int]]:
    """Row-group ranges of about ``chunk_bytes`` each; checks here that the record's columns exist."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    storage = open_input_storage(file.root, endpoint_url, region)
    try:
        metadata = pq.ParquetFile(RangeFile(storage, file.key, file.size)).metadata
        schema = metadata.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as error:
        raise UserError(f"input {file.uri} is not a readable Parquet file ({error})") from None
    for name, flag in zip(fields.names, fields.flags):
        if name not in schema.names:
            columns = ", ".join(repr(column) for column in schema.names[:8])
            raise UserError(f"input {file.uri} has no column {name!r} (its columns: {columns}); name it with {flag}")
        kind = str(schema.field(name).type)
        # A chat column holds a list of message structs; each row's messages are checked as they are read.
        if fields.corpus_format != CorpusFormat.CHAT and kind not in _TEXT_TYPES:
            raise UserError(f"input {file.uri}: column {name!r} holds {kind}, not text; name a string column")
    if metadata.num_rows == 0:
        raise UserError(f"input {file.uri} holds no rows; remove it from --input")
    runs: list[tuple[int, int]] = []
    start, size = 0, 0
    for group in range(metadata.num_row_groups):
        size += metadata.row_group(group).total_byte_size
        if size >= chunk_bytes or group == metadata.num_row_groups - 1:
            runs.append((start, group + 1))
            start, size = group + 1, 0
    return runs


def locate(file: InputFile, offset: int, *, endpoint_url: str | None, region: str | None) -> str:
    """Where a reported problem is: the file, and its line (``.jsonl``) or row index (``.parquet``)."""
    if offset < 0 or file.format == "txt":
        return f"input {file.uri}"
    if file.format == "parquet":
        return f"input {file.uri} row index {offset}"
    storage = open_input_storage(file.root, endpoint_url, region)
    newlines = 0
    try:  # only on the way to an error message: counting lines up to the bad one is affordable
        for begin in range(0, offset, _COUNT_BYTES):
            newlines += storage.get_range(file.key, begin, min(offset, begin + _COUNT_BYTES)).count(b"\n")
    except CheckpointError:
        return f"input {file.uri} byte {offset}"
    return f"input {file.uri} line {newlines + 1}"
