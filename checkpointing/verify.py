"""Verify a committed checkpoint end to end: every byte of every shard against the manifest.

Runs wherever ``meshpilot ckpt verify`` runs (the user's terminal, or the driver); torch-free.
For each shard file: the header's checksum, a strict parse of the safetensors header, that the
header places every tensor exactly where the manifest says, then every checksum block of every
chunk. Problems are collected and raised together, each naming the object.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from checkpointing.catalog import load_manifest
from checkpointing.errors import CheckpointError, CorruptCheckpointError
from checkpointing.manifest import Manifest
from checkpointing.shardfile import parse_header
from checkpointing.spec import CHECKSUM_ALGORITHM, ChunkEntry, FileEntry
from checkpointing.storage import StorageBackend

WINDOW_BYTES = 64 << 20


@dataclass
class VerifyResult:
    step: int
    files: int = 0
    bytes: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)  # (object key, what is wrong)


def verify_checkpoint(storage: StorageBackend, step: int | None = None, *, concurrency: int = 4) -> VerifyResult:
    """Check one committed step; raise ``CorruptCheckpointError`` listing every bad object."""
    manifest = load_manifest(storage, step)
    result = VerifyResult(step=manifest.step)
    by_file: dict[str, list[ChunkEntry]] = {entry.key: [] for entry in manifest.files}
    for index in manifest.tensors.values():
        for chunk in index.chunks:
            by_file[chunk.key].append(chunk)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="meshpilot-verify") as pool:
        outcomes = list(
            pool.map(lambda entry: _verify_file(storage, manifest, entry, by_file[entry.key]), manifest.files)
        )
    for entry, problems in zip(manifest.files, outcomes):
        result.files += 1
        result.bytes += entry.bytes
        result.problems.extend((entry.key, problem) for problem in problems)
    if result.problems:
        lines = [f"shard {storage.uri}/{key}: {problem}" for key, problem in result.problems]
        raise CorruptCheckpointError(
            f"checkpoint step {manifest.step} under {storage.uri} is corrupt:\n  " + "\n  ".join(lines),
            key=result.problems[0][0],
        )
    return result


def _verify_file(storage: StorageBackend, manifest: Manifest, entry: FileEntry, chunks: list[ChunkEntry]) -> list[str]:
    try:
        header = storage.get_range(entry.key, 0, entry.header_bytes)
    except CheckpointError as error:
        return [str(error)]
    problems = []
    if _digest(header) != entry.header_checksum:
        problems.append(f"header fails its {CHECKSUM_ALGORITHM} check")
    try:
        placed, _ = parse_header(header, key=entry.key, object_bytes=entry.bytes)
    except CorruptCheckpointError as error:
        return problems + [str(error)]
    in_header = {(e.begin, e.end, e.dtype, e.shape) for e in placed}
    for chunk in chunks:
        dtype = manifest.tensors[chunk.fqn].dtype
        if (chunk.start, chunk.end, dtype, chunk.sizes) not in in_header:
            problems.append(f"the header does not hold tensor {chunk.fqn!r} at bytes [{chunk.start}, {chunk.end})")
    for chunk in chunks:
        problems.extend(_verify_chunk(storage, entry.key, chunk))
    return problems


def _verify_chunk(storage: StorageBackend, key: str, chunk: ChunkEntry) -> list[str]:
    """Check every block of a chunk, fetching about WINDOW_BYTES at a time."""
    total = chunk.end - chunk.start
    if total == 0:
        return []
    if chunk.sizes:
        block = chunk.block_rows * (total // chunk.sizes[0])
    else:
        block = total
    blocks_per_window = max(1, WINDOW_BYTES // max(1, block))
    problems = []
    for first in range(0, len(chunk.checksums), blocks_per_window):
        begin = chunk.start + first * block
        end = min(chunk.end, begin + blocks_per_window * block)
        try:
            data = memoryview(storage.get_range(key, begin, end))
        except CheckpointError as error:
            return [str(error)]
        for number in range(first, min(first + blocks_per_window, len(chunk.checksums))):
            offset = (number - first) * block
            if _digest(data[offset : offset + block]) != chunk.checksums[number]:
                problems.append(
                    f"tensor {chunk.fqn!r} block {number} (bytes {begin + offset}+) fails its "
                    f"{CHECKSUM_ALGORITHM} check"
                )
    return problems


def _digest(data) -> str:
    return f"{CHECKSUM_ALGORITHM}:{hashlib.new(CHECKSUM_ALGORITHM, data).hexdigest()}"
