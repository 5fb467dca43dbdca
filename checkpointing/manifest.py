"""The versioned JSON manifest: the index of one committed checkpoint, and its strict parser.

Built on the driver by the commit coordinator from every rank's ``ShardReport``; read by the
ranks (restore), the driver (resume, retention) and the CLI. Torch-free.

Version 1 (``"format": "meshpilot-checkpoint", "version": 1``)::

    step, committed_at (unix seconds), config_hash, model {dim, n_layers, ...}, mesh {dp_replicate,
    dp_shard, tp, pp}, world_size, extra {data cursor, RNG, LR schedule: whatever the trainer gave;
    "weights_only": true for an imported model; "lora" and "lora_base" for a LoRA run's adapters},
    timings {upload_s, stall_s},
    files   [{key, rank, bytes, header_bytes, header_checksum}],
    tensors {fqn: {shape, dtype, chunks: [{offsets, sizes, file (index into files), start, end,
                                           block_rows, checksums: ["sha256:<hex>", ...]}]}},
    checksum  "sha256:<hex>" of the canonical JSON of every other field.

Parsing dispatches on ``version`` to an explicit parser per version, so manifests written by
older releases keep loading; a newer version is refused with a message saying to upgrade.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from checkpointing.errors import CorruptCheckpointError, ManifestVersionError
from checkpointing.spec import (
    CHECKSUM_ALGORITHM,
    DTYPES,
    FORMAT,
    MANIFEST_VERSION,
    WEIGHTS_ONLY,
    ChunkEntry,
    FileEntry,
    ShardReport,
    TensorEntry,
    block_count,
    itemsize,
)

MAX_MANIFEST_BYTES = 256 << 20
# ``extra`` keys of a LoRA run's checkpoint: its adapter settings ({rank, alpha, dropout,
# target_modules}) and the frozen base they were trained beside ({source, sha256}: the
# ``model.init_from`` URI or ``random-init:seed=<seed>``, see ``workers.spec.lora.LoraBase``).
LORA = "lora"
LORA_BASE = "lora_base"


@dataclass(frozen=True)
class TensorIndex:
    """A global tensor and the chunks that tile it."""

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[ChunkEntry, ...]


@dataclass(frozen=True)
class Manifest:
    step: int
    model: dict[str, Any]
    mesh: dict[str, Any]
    world_size: int
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorIndex]
    config_hash: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0
    upload_s: float = 0.0
    stall_s: float = 0.0
    version: int = MANIFEST_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files)

    @property
    def weights_only(self) -> bool:
        """Model weights without optimizer state or data cursor (an import); marked in ``extra``."""
        return self.extra.get(WEIGHTS_ONLY) is True

    @property
    def lora(self) -> dict[str, Any] | None:
        """A LoRA run's adapter settings (``rank``, ``alpha``, ``dropout``, ``target_modules``); None
        for a checkpoint of every weight. Its tensors are then the adapters and their optimizer state."""
        found = self.extra.get(LORA)
        return found if isinstance(found, dict) else None

    @property
    def lora_base(self) -> dict[str, Any] | None:
        """The frozen base of a LoRA checkpoint: ``source`` and ``sha256`` (see ``LORA_BASE``)."""
        found = self.extra.get(LORA_BASE)
        return found if isinstance(found, dict) else None

    def to_json(self) -> bytes:
        """The canonical bytes of this manifest (current version), checksum included."""
        file_index = {entry.key: number for number, entry in enumerate(self.files)}
        body: dict[str, Any] = {
            "format": FORMAT,
            "version": MANIFEST_VERSION,
            "step": self.step,
            "committed_at": self.committed_at,
            "config_hash": self.config_hash,
            "model": self.model,
            "mesh": self.mesh,
            "world_size": self.world_size,
            "extra": self.extra,
            "timings": {"upload_s": self.upload_s, "stall_s": self.stall_s},
            "files": [
                {
                    "key": f.key,
                    "rank": f.rank,
                    "bytes": f.bytes,
                    "header_bytes": f.header_bytes,
                    "header_checksum": f.header_checksum,
                }
                for f in self.files
            ],
            "tensors": {
                fqn: {
                    "shape": list(index.shape),
                    "dtype": index.dtype,
                    "chunks": [
                        {
                            "offsets": list(c.offsets),
                            "sizes": list(c.sizes),
                            "file": file_index[c.key],
                            "start": c.start,
                            "end": c.end,
                            "block_rows": c.block_rows,
                            "checksums": list(c.checksums),
                        }
                        for c in index.chunks
                    ],
                }
                for fqn, index in sorted(self.tensors.items())
            },
        }
        body["checksum"] = _digest(body)
        return json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"


def build_manifest(
    reports: list[ShardReport],
    *,
    step: int,
    world_size: int,
    mesh: dict[str, Any],
    model: dict[str, Any],
    config_hash: str | None,
    committed_at: float | None = None,
    checked: bool = True,
) -> Manifest:
    """Merge one step's shard reports; raise CorruptCheckpointError if they do not tile every tensor.

    ``checked=False`` skips the parser's round trip: for an index of slices in memory (peer
    snapshots), which carries no checksums and is never committed."""
    shapes: dict[str, TensorEntry] = {}
    chunks: dict[str, list[ChunkEntry]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        for tensor in report.tensors:
            known = shapes.setdefault(tensor.fqn, tensor)
            if (known.shape, known.dtype) != (tensor.shape, tensor.dtype):
                raise CorruptCheckpointError(
                    f"ranks disagree on tensor {tensor.fqn!r}: {known.shape} {known.dtype} vs "
                    f"{tensor.shape} {tensor.dtype} (rank {report.rank})",
                    key=tensor.fqn,
                )
        for chunk in report.chunks:
            chunks.setdefault(chunk.fqn, []).append(chunk)
    chunks = {fqn: _drop_identical_copies(fqn, found) for fqn, found in chunks.items()}
    tensors = {
        fqn: TensorIndex(
            shape=entry.shape, dtype=entry.dtype, chunks=tuple(sorted(chunks.get(fqn, ()), key=lambda c: c.offsets))
        )
        for fqn, entry in shapes.items()
    }
    by_rank = {report.rank: report for report in reports}
    extra = by_rank[min(by_rank)].extra if by_rank else {}
    manifest = Manifest(
        step=step,
        model=model,
        mesh=mesh,
        world_size=world_size,
        files=tuple(f for report in sorted(reports, key=lambda r: r.rank) for f in report.files),
        tensors=tensors,
        config_hash=config_hash,
        extra=extra,
        committed_at=time.time() if committed_at is None else committed_at,
        upload_s=max((r.upload_s for r in reports), default=0.0),
        stall_s=max((r.stall_s for r in reports), default=0.0),
    )
    if not checked:
        return manifest
    # Round-trip through the parser: the coordinator commits only what a reader will accept.
    return parse_manifest(manifest.to_json(), key=f"of step {step} (being committed)")


def _drop_identical_copies(fqn: str, chunks: list[ChunkEntry]) -> list[ChunkEntry]:
    """Keep one of several byte-identical copies of a slice (replicas the writers could not tell apart).

    Copies with different checksums mean the replicas diverged: that is refused, not guessed.
    """
    kept: dict[tuple, ChunkEntry] = {}
    for chunk in chunks:
        place = (chunk.offsets, chunk.sizes)
        first = kept.setdefault(place, chunk)
        if first is not chunk and first.checksums != chunk.checksums:
            raise CorruptCheckpointError(
                f"replicas of tensor {fqn!r} at offsets {list(chunk.offsets)} differ ({first.key} vs {chunk.key}): "
                "the data-parallel copies diverged",
                key=chunk.key,
            )
    return list(kept.values())


# ------------------------------------------------------------------------------- parsing
def parse_manifest(data: bytes, *, key: str) -> Manifest:
    """Parse and validate manifest bytes of any known version; every problem names ``key``."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise _corrupt(key, f"it is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise _corrupt(key, f"it is not valid JSON ({type(error).__name__})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ManifestVersionError(f'{key} is not a meshpilot checkpoint manifest (no "format": "{FORMAT}")')
    version = body.get("version")
    if not _is_int(version) or version < 1:
        raise _corrupt(key, f"version {version!r} is not a positive integer")
    parser = _PARSERS.get(version)
    if parser is None:
        raise ManifestVersionError(
            f"{key} has manifest version {version}; this meshpilot reads versions up to {MANIFEST_VERSION}: "
            "upgrade meshpilot to load it"
        )
    return parser(body, key)


def _parse_v1(body: dict[str, Any], key: str) -> Manifest:
    check = _Checker(key)
    expected = body.get("checksum")
    unsigned = {name: value for name, value in body.items() if name != "checksum"}
    try:
        actual = _digest(unsigned)
    except (ValueError, TypeError, RecursionError):  # NaN or absurd nesting: not something we wrote
        actual = None
    if not isinstance(expected, str) or expected != actual:
        raise _corrupt(key, "its checksum does not match its content")
    step = check.count(body.get("step"), "step")
    world_size = check.count(body.get("world_size"), "world_size", minimum=1)
    timings = check.mapping(body.get("timings"), "timings")
    files = []
    for number, raw in enumerate(check.sequence(body.get("files"), "files")):
        where = f"files[{number}]"
        raw = check.mapping(raw, where)
        files.append(
            FileEntry(
                key=check.text(raw.get("key"), f"{where}.key"),
                rank=check.count(raw.get("rank"), f"{where}.rank"),
                bytes=check.count(raw.get("bytes"), f"{where}.bytes"),
                header_bytes=check.count(raw.get("header_bytes"), f"{where}.header_bytes", minimum=8),
                header_checksum=check.checksum(raw.get("header_checksum"), f"{where}.header_checksum"),
            )
        )
    if len({f.key for f in files}) != len(files):
        raise _corrupt(key, "two files have the same key")
    tensors = {}
    for fqn, raw in check.mapping(body.get("tensors"), "tensors").items():
        tensors[fqn] = _tensor_v1(check, fqn, raw, files)
    return Manifest(
        version=1,
        step=step,
        world_size=world_size,
        files=tuple(files),
        tensors=tensors,
        model=check.mapping(body.get("model"), "model"),
        mesh=check.mapping(body.get("mesh"), "mesh"),
        config_hash=None if body.get("config_hash") is None else check.text(body.get("config_hash"), "config_hash"),
        extra=check.mapping(body.get("extra"), "extra"),
        committed_at=check.number(body.get("committed_at"), "committed_at"),
        upload_s=check.number(timings.get("upload_s", 0.0), "timings.upload_s"),
        stall_s=check.number(timings.get("stall_s", 0.0), "timings.stall_s"),
    )


def _tensor_v1(check: _Checker, fqn: str, raw: Any, files: list[FileEntry]) -> TensorIndex:
    where = f"tensors[{fqn!r}]"
    raw = check.mapping(raw, where)
    shape = tuple(check.count(d, f"{where}.shape") for d in check.sequence(raw.get("shape"), f"{where}.shape"))
    dtype = raw.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _corrupt(check.key, f"{where}.dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    chunks = []
    for number, item in enumerate(check.sequence(raw.get("chunks"), f"{where}.chunks")):
        at = f"{where}.chunks[{number}]"
        item = check.mapping(item, at)
        offsets = tuple(check.count(o, f"{at}.offsets") for o in check.sequence(item.get("offsets"), f"{at}.offsets"))
        sizes = tuple(check.count(s, f"{at}.sizes") for s in check.sequence(item.get("sizes"), f"{at}.sizes"))
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _corrupt(
                check.key, f"{at} has {len(offsets)} offsets and {len(sizes)} sizes for a {len(shape)}-dim tensor"
            )
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            raise _corrupt(check.key, f"{at} (offsets {offsets}, sizes {sizes}) lies outside shape {shape}")
        file_number = check.count(item.get("file"), f"{at}.file")
        if file_number >= len(files):
            raise _corrupt(check.key, f"{at}.file {file_number} names no file (there are {len(files)})")
        owner = files[file_number]
        start, end = check.count(item.get("start"), f"{at}.start"), check.count(item.get("end"), f"{at}.end")
        if not owner.header_bytes <= start <= end <= owner.bytes or end - start != math.prod(sizes) * itemsize(dtype):
            raise _corrupt(
                check.key,
                f"{at} byte range [{start}, {end}) does not fit its sizes {sizes} of {dtype} "
                f"inside {owner.key} ({owner.bytes} bytes)",
            )
        rows = check.count(item.get("block_rows"), f"{at}.block_rows", minimum=1)
        sums = tuple(
            check.checksum(c, f"{at}.checksums") for c in check.sequence(item.get("checksums"), f"{at}.checksums")
        )
        if len(sums) != block_count(sizes, rows):
            raise _corrupt(check.key, f"{at} has {len(sums)} checksums for {block_count(sizes, rows)} blocks")
        chunks.append(
            ChunkEntry(
                fqn=fqn,
                offsets=offsets,
                sizes=sizes,
                key=owner.key,
                start=start,
                end=end,
                block_rows=rows,
                checksums=sums,
            )
        )
    _check_tiling(check.key, fqn, shape, chunks)
    return TensorIndex(shape=shape, dtype=dtype, chunks=tuple(chunks))


def _check_tiling(key: str, fqn: str, shape: tuple[int, ...], chunks: list[ChunkEntry]) -> None:
    """The chunks cover the tensor exactly once: no gap (a torn save), no overlap (a double writer)."""
    ordered = sorted(chunks, key=lambda c: c.offsets)
    for number, chunk in enumerate(ordered):
        for other in ordered[number + 1 :]:
            if shape and other.offsets[0] >= chunk.offsets[0] + chunk.sizes[0]:
                break  # sorted by dim 0: no later chunk can overlap this one
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(chunk.offsets, chunk.sizes, other.offsets, other.sizes)
            ):
                raise _corrupt(
                    key,
                    f"tensor {fqn!r} is stored twice: chunks at offsets {list(chunk.offsets)} "
                    f"({chunk.key}) and {list(other.offsets)} ({other.key}) overlap; exactly one rank "
                    "must own each slice",
                )
    covered = sum(math.prod(c.sizes) for c in chunks)
    if covered != math.prod(shape):
        raise _corrupt(key, f"tensor {fqn!r} is incomplete: its chunks hold {covered} of {math.prod(shape)} elements")


_PARSERS: dict[int, Callable[[dict[str, Any], str], Manifest]] = {1: _parse_v1}


class _Checker:
    """Type checks that turn any malformed field into one error naming the manifest and field."""

    def __init__(self, key: str) -> None:
        self.key = key

    def mapping(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise _corrupt(self.key, f"{where} must be an object, not {type(value).__name__}")
        return value

    def sequence(self, value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise _corrupt(self.key, f"{where} must be a list, not {type(value).__name__}")
        return value

    def text(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise _corrupt(self.key, f"{where} must be a non-empty string")
        return value

    def count(self, value: Any, where: str, *, minimum: int = 0) -> int:
        if not _is_int(value) or not minimum <= value < 1 << 62:
            raise _corrupt(self.key, f"{where} must be an integer >= {minimum}, not {value!r}"[:300])
        return value

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _corrupt(self.key, f"{where} must be a finite number, not {value!r}"[:300])
        return float(value)

    def checksum(self, value: Any, where: str) -> str:
        prefix = CHECKSUM_ALGORITHM + ":"
        if not (
            isinstance(value, str)
            and value.startswith(prefix)
            and len(value) == len(prefix) + 64
            and all(c in "0123456789abcdef" for c in value[len(prefix) :])
        ):
            raise _corrupt(self.key, f"{where} must be '{prefix}<64 hex digits>', not {value!r}"[:300])
        return value


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return f"{CHECKSUM_ALGORITHM}:{hashlib.sha256(canonical).hexdigest()}"


def _corrupt(key: str, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint manifest {key} is corrupt: {reason}", key=key)
