"""The safetensors container of one shard file: header building (writer) and strict parsing (verify).

A safetensors file is ``u64 little-endian N`` + ``N bytes of JSON header`` + data, where the
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative
to the data, with no gaps. The writer lays its host buffer out exactly like that, so the
buffer *is* the file and uploads without a serialisation copy. The parser never trusts a
length or an offset: every malformed header is a ``CorruptCheckpointError`` naming the object.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

from checkpointing.errors import CorruptCheckpointError
from checkpointing.spec import DTYPES, SAFETENSORS_DTYPES

MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own bound
_ALIGN = 8


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor in a shard file: ``[begin, end)`` are absolute offsets in the object."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    begin: int
    end: int


def build_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> tuple[bytes, list[HeaderEntry]]:
    """Header bytes (length prefix included, padded to 8 bytes) and the absolute place of each tensor.

    ``tensors`` is ``[(name, torch dtype name, shape)]`` in file order; callers order them by
    decreasing element size so that every tensor starts aligned to its element size.
    """
    body: dict[str, object] = {"__metadata__": dict(metadata)}
    relative = []
    position = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        body[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [position, position + nbytes]}
        relative.append((name, dtype, tuple(shape), position, position + nbytes))
        position += nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)  # data starts 8-byte aligned, as safetensors pads
    header = struct.pack("<Q", len(text)) + text
    start = len(header)
    entries = [
        HeaderEntry(name, dtype, shape, start + begin, start + end) for name, dtype, shape, begin, end in relative
    ]
    return header, entries


def header_size(first8: bytes, *, key: str, object_bytes: int | None = None) -> int:
    """Total header size (prefix included) read from the first 8 bytes of an object."""
    if len(first8) < 8:
        raise CorruptCheckpointError(
            f"shard {key!r} is {len(first8)} bytes long: too short for a safetensors header", key=key
        )
    (length,) = struct.unpack("<Q", first8[:8])
    limit = MAX_HEADER_BYTES if object_bytes is None else min(MAX_HEADER_BYTES, object_bytes - 8)
    if length > limit:
        raise CorruptCheckpointError(
            f"shard {key!r} has a corrupt safetensors header: it claims {length} header "
            f"bytes, more than the {limit} possible",
            key=key,
        )
    return 8 + length


def parse_header(
    header: bytes, *, key: str, object_bytes: int | None = None
) -> tuple[list[HeaderEntry], dict[str, str]]:
    """Validate a whole header (prefix included) and return its entries (absolute offsets) and metadata."""
    total = header_size(header[:8], key=key, object_bytes=object_bytes)
    if len(header) < total:
        raise _corrupt(key, f"the header is truncated ({len(header)} of {total} bytes)")
    try:
        body = json.loads(header[8:total].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(key, f"the header is not valid JSON ({type(error).__name__})") from None
    if not isinstance(body, dict):
        raise _corrupt(key, "the header is not a JSON object")
    metadata = body.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _corrupt(key, "__metadata__ must map strings to strings")
    entries = []
    for name, spec in body.items():
        entries.append(_entry(name, spec, total, key))
    entries.sort(key=lambda entry: entry.begin)
    position = total
    for entry in entries:
        if entry.begin != position:
            raise _corrupt(
                key,
                f"tensor {entry.name!r} starts at byte {entry.begin}, expected {position} "
                "(gaps and overlaps are not allowed)",
            )
        position = entry.end
    if object_bytes is not None and position != object_bytes:
        raise _corrupt(key, f"the header describes {position} bytes but the object has {object_bytes}")
    return entries, metadata


def _entry(name: str, spec: object, data_start: int, key: str) -> HeaderEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(key, f"tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype = SAFETENSORS_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise _corrupt(key, f"tensor {name!r} has unknown dtype {spec['dtype']!r}")
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _corrupt(key, f"tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _corrupt(key, f"tensor {name!r} has invalid data_offsets {offsets!r}")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype][1]:
        raise _corrupt(key, f"tensor {name!r}: data_offsets {offsets} do not match shape {shape} of {dtype}")
    return HeaderEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _corrupt(key: str, reason: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"shard {key!r} has a corrupt safetensors header: {reason}", key=key)
