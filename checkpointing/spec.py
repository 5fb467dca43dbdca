"""Plain values of the checkpoint format, shared by the ranks (writer), the driver (coordinator)
and the CLI. No torch here: the driver builds and commits manifests without importing it.

Layout under a checkpoint URI (keys relative to it)::

    step-00000010/rank-00000-1a2b3c4d.safetensors   one shard file per writing rank (unique name per save)
    step-00000010/rank-00003-5e6f7a8b.safetensors
    step-00000010/manifest.json                     written last, with put-if-absent: the commit

A rank reports what it wrote as a ``ShardReport`` (or a ``FailureReport``); the coordinator
turns world_size reports into a ``checkpointing.manifest.Manifest``.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT = "meshpilot-checkpoint"
MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGORITHM = "sha256"
# Optimizer state is saved as ``optim.{param}.{exp_avg|exp_avg_sq|step}`` next to the parameters.
OPTIMIZER_PREFIX = "optim."
# ``manifest.extra[WEIGHTS_ONLY] is True``: the checkpoint holds model weights only (an import from
# Hugging Face), so a restore loads the parameters and leaves the optimizer fresh.
WEIGHTS_ONLY = "weights_only"
# Rows of dim 0 are grouped into checksum blocks of about this size, so a reader that needs a
# slice of a chunk fetches and verifies only the blocks it covers.
BLOCK_BYTES = 4 << 20

# torch dtype name -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
}
SAFETENSORS_DTYPES: dict[str, str] = {safe: name for name, (safe, _) in DTYPES.items()}

_STEP_PREFIX = re.compile(r"^step-(\d{8,})/")


def step_prefix(step: int) -> str:
    return f"step-{step:08d}/"


def manifest_key(step: int) -> str:
    return step_prefix(step) + MANIFEST_NAME


def step_of_key(key: str) -> int | None:
    """The step a key belongs to, or None for keys outside any step prefix."""
    match = _STEP_PREFIX.match(key)
    return int(match.group(1)) if match else None


def itemsize(dtype: str) -> int:
    return DTYPES[dtype][1]


def block_rows(sizes: tuple[int, ...], dtype: str) -> int:
    """Rows of dim 0 per checksum block for a chunk of these sizes (1 for a 0-dim chunk)."""
    if not sizes:
        return 1
    row_bytes = math.prod(sizes[1:]) * itemsize(dtype)
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def block_count(sizes: tuple[int, ...], rows: int) -> int:
    return 1 if not sizes else -(-sizes[0] // rows)


@dataclass(frozen=True)
class TensorEntry:
    """A whole (global) tensor: its name, global shape and dtype."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ChunkEntry:
    """One stored slice of a tensor and where its bytes are.

    ``offsets``/``sizes`` place the slice in the global tensor; its bytes are ``[start, end)``
    of object ``key`` (row-major). Each run of ``block_rows`` rows of dim 0 has one checksum.
    """

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key: str
    start: int
    end: int
    block_rows: int
    checksums: tuple[str, ...]


@dataclass(frozen=True)
class FileEntry:
    """One shard object: its key, size, the rank that wrote it and its header's checksum.

    Every byte after the header belongs to exactly one chunk and is covered by the chunk's
    block checksums, so header checksum + block checksums verify the whole object.
    """

    key: str
    rank: int
    bytes: int
    header_bytes: int
    header_checksum: str


@dataclass(frozen=True)
class ShardReport:
    """What one rank made durable for one step (possibly nothing: ``files`` empty)."""

    step: int
    rank: int
    files: tuple[FileEntry, ...] = ()
    tensors: tuple[TensorEntry, ...] = ()
    chunks: tuple[ChunkEntry, ...] = ()
    upload_s: float = 0.0
    stall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    kind: str = "shard"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FailureReport:
    """A rank gave up on a step after its retries; the step is never committed."""

    step: int
    rank: int
    error: str
    attempts: int = 1
    kind: str = "failure"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def report_from_dict(data: dict[str, Any]) -> ShardReport | FailureReport:
    """Rebuild a report that crossed a process boundary as a JSON-able dict."""
    if not isinstance(data, dict) or data.get("kind") not in ("shard", "failure"):
        raise ValueError(f"not a checkpoint report: {str(data)[:200]}")
    if data["kind"] == "failure":
        return FailureReport(
            step=int(data["step"]),
            rank=int(data["rank"]),
            error=str(data["error"]),
            attempts=int(data.get("attempts", 1)),
        )
    return ShardReport(
        step=int(data["step"]),
        rank=int(data["rank"]),
        files=tuple(FileEntry(**entry) for entry in data.get("files", ())),
        tensors=tuple(
            TensorEntry(fqn=t["fqn"], shape=tuple(t["shape"]), dtype=t["dtype"]) for t in data.get("tensors", ())
        ),
        chunks=tuple(
            ChunkEntry(
                fqn=c["fqn"],
                offsets=tuple(c["offsets"]),
                sizes=tuple(c["sizes"]),
                key=c["key"],
                start=int(c["start"]),
                end=int(c["end"]),
                block_rows=int(c["block_rows"]),
                checksums=tuple(c["checksums"]),
            )
            for c in data.get("chunks", ())
        ),
        upload_s=float(data.get("upload_s", 0.0)),
        stall_s=float(data.get("stall_s", 0.0)),
        extra=dict(data.get("extra") or {}),
    )
