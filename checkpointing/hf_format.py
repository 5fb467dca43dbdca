"""Hugging Face model directories (``config.json`` + safetensors), read slice by slice.

Runs wherever a released model's weights are loaded: on every rank that initialises from one
(each rank independently, no collective) and in ``meshpilot ckpt import`` (one process)::

    checkpoint = open_hf_checkpoint(storage)      # config.json + every file's header, by ranged GETs
    load_hf_tensors(storage, checkpoint, state, names)   # state: our FQN -> DTensor or plain tensor

The directory holds ``config.json`` and either one ``model.safetensors`` or
``model.safetensors.index.json`` whose ``weight_map`` names the file of each tensor. A
safetensors file is a little-endian u64 header length N, N bytes of JSON header, then the data;
the header's ``data_offsets`` count from byte 8 + N. Opening reads only config.json, the index
and each file's header; loading turns the headers into an in-memory ``Manifest`` (one chunk per
tensor, no checksums: a released model publishes none) and hands it to the same resharding
reader as a restore, so each rank fetches only the rows its slices need and casts them to its
parameters' dtype on copy.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from checkpointing.errors import HfCheckpointError
from checkpointing.manifest import Manifest, TensorIndex
from checkpointing.reader import read_into
from checkpointing.spec import DTYPES, SAFETENSORS_DTYPES, ChunkEntry
from checkpointing.storage import StorageBackend

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own bound
MAX_JSON_BYTES = 64 << 20  # config.json and the index are a few KB to a few MB
_COPY_FIX = "copy the complete model directory"

# The HF tensor a parameter maps to, or several stacked along a new first dimension (in order).
HfName = str | tuple[str, ...]


@dataclass(frozen=True)
class HfTensor:
    """One tensor of a Hugging Face checkpoint: its bytes are ``[start, end)`` of ``file`` (absolute)."""

    name: str
    file: str
    dtype: str  # our dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class HfCheckpoint:
    """What ``open_hf_checkpoint`` found: the parsed config.json and every tensor's place."""

    uri: str
    config: dict[str, Any]
    tensors: dict[str, HfTensor]

    @property
    def total_bytes(self) -> int:
        return sum(tensor.end - tensor.start for tensor in self.tensors.values())


def open_hf_checkpoint(storage: StorageBackend, *, concurrency: int = 8) -> HfCheckpoint:
    """Read config.json, the index (or the single file's name) and every weight file's header.

    Never downloads a weight file: two ranged GETs per file (the length, then the header),
    the files in parallel. Raises ``HfCheckpointError`` naming the file and the fix.
    """
    sizes = {info.key: info.size for info in storage.list()}
    if CONFIG_NAME not in sizes:
        raise HfCheckpointError(
            f"{storage.uri} has no {CONFIG_NAME}: point at a Hugging Face model directory "
            f"(the one holding {CONFIG_NAME} and model*.safetensors)"
        )
    config = _read_json(storage, CONFIG_NAME, sizes[CONFIG_NAME])
    file_of = _weight_files(storage, sizes)
    files = sorted(set(file_of.values())) if file_of else [SINGLE_FILE]
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(files))), thread_name_prefix="hf-header") as pool:
        headers = dict(zip(files, pool.map(lambda file: _read_header(storage, file, sizes[file]), files)))
    if not file_of:
        return HfCheckpoint(uri=storage.uri, config=config, tensors=headers[SINGLE_FILE])
    tensors = {}
    for name, file in sorted(file_of.items()):
        found = headers[file].get(name)
        if found is None:
            raise HfCheckpointError(
                f"{storage.uri}/{INDEX_NAME} puts tensor {name} in {file}, whose header has no such tensor: "
                f"the index and the weight files come from different downloads; {_COPY_FIX} again"
            )
        tensors[name] = found
    return HfCheckpoint(uri=storage.uri, config=config, tensors=tensors)


def _weight_files(storage: StorageBackend, sizes: dict[str, int]) -> dict[str, str]:
    """The index's weight_map (HF tensor name -> file), or {} for a single model.safetensors."""
    if SINGLE_FILE in sizes:  # transformers prefers the single file too when both are there
        return {}
    if INDEX_NAME not in sizes:
        raise HfCheckpointError(
            f"{storage.uri} has neither {SINGLE_FILE} nor {INDEX_NAME}: {_COPY_FIX} with its safetensors "
            "weights (pytorch_model.bin and other pickled formats are not read)"
        )
    index = _read_json(storage, INDEX_NAME, sizes[INDEX_NAME])
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) for name, file in weight_map.items()
    ):
        raise HfCheckpointError(
            f"{storage.uri}/{INDEX_NAME} has no weight_map of tensor names to file names: "
            f"the file is damaged; {_COPY_FIX} again"
        )
    for file in sorted(set(weight_map.values())):
        if file not in sizes:
            raise HfCheckpointError(
                f"{storage.uri}/{INDEX_NAME} names {file}, which is missing from {storage.uri}: {_COPY_FIX}"
            )
    return dict(weight_map)


def _read_json(storage: StorageBackend, key: str, size: int) -> dict[str, Any]:
    if size > MAX_JSON_BYTES:
        raise HfCheckpointError(f"{storage.uri}/{key} is {size} bytes, more than {MAX_JSON_BYTES}: it is not {key}")
    try:
        body = json.loads(storage.get(key).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise HfCheckpointError(
            f"{storage.uri}/{key} is not valid JSON ({type(error).__name__}): {_COPY_FIX} again"
        ) from None
    if not isinstance(body, dict):
        raise HfCheckpointError(f"{storage.uri}/{key} is not a JSON object: {_COPY_FIX} again")
    return body


def _read_header(storage: StorageBackend, file: str, size: int) -> dict[str, HfTensor]:
    """Every tensor of one safetensors file, from its header alone (two ranged GETs)."""
    where = f"{storage.uri}/{file}"
    if size < 8:
        raise _malformed(where, f"the file is {size} bytes long, too short for a header")
    (length,) = struct.unpack("<Q", storage.get_range(file, 0, 8))
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise _malformed(where, f"it claims a {length}-byte header in a {size}-byte file")
    try:
        body = json.loads(storage.get_range(file, 8, 8 + length).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise _malformed(where, f"the header is not valid JSON ({type(error).__name__})") from None
    if not isinstance(body, dict):
        raise _malformed(where, "the header is not a JSON object")
    body.pop("__metadata__", None)
    return {name: _tensor(where, file, name, spec, data_start=8 + length, size=size) for name, spec in body.items()}


def _tensor(where: str, file: str, name: str, spec: Any, *, data_start: int, size: int) -> HfTensor:
    if not isinstance(spec, dict) or not {"dtype", "shape", "data_offsets"} <= set(spec):
        raise _malformed(where, f"tensor {name} lacks dtype, shape or data_offsets")
    dtype = SAFETENSORS_DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    if dtype is None:
        raise HfCheckpointError(
            f"{where}: tensor {name} has safetensors dtype {spec['dtype']!r}, which meshpilot cannot load "
            f"(it reads {', '.join(SAFETENSORS_DTYPES)}): convert the weights to BF16 or F32 first"
        )
    shape, offsets = spec["shape"], spec["data_offsets"]
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _malformed(where, f"tensor {name} has an invalid shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise _malformed(where, f"tensor {name} has invalid data_offsets {offsets!r}")
    start, end = data_start + offsets[0], data_start + offsets[1]
    if end - start != math.prod(shape) * DTYPES[dtype][1] or end > size:
        raise _malformed(
            where, f"tensor {name}: data_offsets {offsets} do not fit shape {shape} of {dtype} in {size} bytes"
        )
    return HfTensor(name=name, file=file, dtype=dtype, shape=tuple(shape), start=start, end=end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _malformed(where: str, reason: str) -> HfCheckpointError:
    return HfCheckpointError(
        f"{where} has a malformed safetensors header ({reason}): the file is truncated or not safetensors; "
        "download it again"
    )


# ------------------------------------------------------------------------------- loading
def load_hf_tensors(
    storage: StorageBackend,
    checkpoint: HfCheckpoint,
    tensors: dict[str, torch.Tensor],
    names: Mapping[str, HfName],
    *,
    concurrency: int = 8,
) -> int:
    """Fill ``tensors`` (our FQN -> allocated DTensor of any mesh, or plain tensor) from the HF tensors
    ``names`` maps them to; return the bytes read.

    Runs on each rank independently. Two FQNs may read the same HF tensor (tied embeddings); one
    FQN may read several, stacked along its first dimension (a family's stacked experts).
    Each destination keeps its dtype: a bfloat16 file fills float32 parameters.
    """
    sources = {fqn: _source(checkpoint, fqn, tensor, names) for fqn, tensor in tensors.items()}
    return read_into(storage, hf_manifest(sources), tensors, verify=False, concurrency=concurrency)


@dataclass(frozen=True)
class HfSource:
    """The HF tensor(s) one parameter reads: one, or several ``stacked`` along a new first dimension."""

    tensors: tuple[HfTensor, ...]
    stacked: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.tensors[0].shape
        return (len(self.tensors), *first) if self.stacked else first

    @property
    def dtype(self) -> str:
        return self.tensors[0].dtype


def find_hf_tensor(checkpoint: HfCheckpoint, fqn: str, names: Mapping[str, HfName]) -> HfSource:
    """The HF tensor(s) parameter ``fqn`` reads; ``HfCheckpointError`` naming both when there is none."""
    name = names.get(fqn)
    if name is None:
        raise HfCheckpointError(
            f"no Hugging Face name is given for parameter {fqn}: the name map must cover every parameter loaded"
        )
    found = []
    for one in (name,) if isinstance(name, str) else name:
        tensor = checkpoint.tensors.get(one)
        if tensor is None:
            raise HfCheckpointError(
                f"{checkpoint.uri} holds no tensor {one} (for parameter {fqn}; it has {len(checkpoint.tensors)} "
                f"tensors): the weights do not belong to this config.json's architecture; {_COPY_FIX} of that model"
            )
        found.append(tensor)
    return HfSource(tuple(found), stacked=not isinstance(name, str))


def check_hf_shape(checkpoint: HfCheckpoint, found: HfSource, shape: tuple[int, ...]) -> None:
    """Refuse an HF tensor whose shape is not the one the model (built from config.json) expects."""
    expected = shape[1:] if found.stacked else shape
    for tensor in found.tensors:
        if tensor.shape != expected or (found.stacked and len(found.tensors) != shape[0]):
            raise HfCheckpointError(
                f"{checkpoint.uri}: tensor {tensor.name} in {tensor.file} has shape {list(tensor.shape)}, the model "
                f"built from config.json expects {list(expected)}: the weights do not belong to this config.json"
            )


def _source(checkpoint: HfCheckpoint, fqn: str, tensor: torch.Tensor, names: Mapping[str, HfName]) -> HfSource:
    found = find_hf_tensor(checkpoint, fqn, names)
    check_hf_shape(checkpoint, found, tuple(tensor.shape))
    return found


def hf_manifest(sources: Mapping[str, HfSource]) -> Manifest:
    """An in-memory index of HF tensors under our FQNs, for ``reader.read_into`` (never committed).

    One chunk per HF tensor (a stacked one's tensor ``i`` is its chunk at row ``i``: the bytes of
    an [a, b] tensor are those of a [1, a, b] one). With no checksums to verify there are no blocks to round to, so a
    chunk's rows are its blocks (``block_rows=1``): a rank fetches exactly the rows it needs.
    """
    tensors = {
        fqn: TensorIndex(
            shape=source.shape,
            dtype=source.dtype,
            chunks=tuple(
                ChunkEntry(
                    fqn=fqn,
                    offsets=(index,) + (0,) * (len(source.shape) - 1) if source.stacked else (0,) * len(source.shape),
                    sizes=(1, *tensor.shape) if source.stacked else tensor.shape,
                    key=tensor.file,
                    start=tensor.start,
                    end=tensor.end,
                    block_rows=1,
                    checksums=(),
                )
                for index, tensor in enumerate(source.tensors)
            ),
        )
        for fqn, source in sources.items()
    }
    return Manifest(step=0, model={}, mesh={}, world_size=1, files=(), tensors=tensors)
