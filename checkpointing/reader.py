"""Restore: load a committed checkpoint into this rank's tensors, whatever mesh wrote it.

Runs on every rank that restores (each independently: no collective), after the driver chose
the step (``catalog.choose_restore``)::

    manifest = load_manifest(storage, step)
    restore(storage, manifest, state, model=model_dict)   # state: FQN -> DTensor of the current
                                                          # mesh or plain tensor, allocated

The slice arithmetic is torch.distributed.checkpoint's: ``manifest_metadata`` turns our JSON
manifest into DCP ``Metadata`` and ``ManifestStorageReader`` is a DCP ``StorageReader``, so
``dcp.load(..., no_dist=True)`` plans, for every destination shard, which stored chunks overlap
it. The reader then fetches only the byte ranges those overlaps need (whole checksum blocks of
dim-0 rows, neighbouring ranges merged into one GET), verifies each block's sha256, and copies
in place. Nothing is unpickled: bytes become tensors through ``torch.frombuffer``.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from checkpointing.catalog import check_compatible, latest_committed, list_committed, load_manifest  # noqa: F401
from checkpointing.errors import CheckpointError, CorruptCheckpointError, ForeignCheckpointError
from checkpointing.manifest import Manifest
from checkpointing.spec import CHECKSUM_ALGORITHM, ChunkEntry
from checkpointing.storage import RangeSource, StorageBackend

# Neighbouring ranges are fetched in one GET when the gap between them is small: under
# SMALL_GAP_BYTES always (many small pieces, e.g. half of every row), under MERGE_GAP_BYTES when
# the gap is at most half of the range it reaches (a rank's half of a tensor of a few MiB is
# not fetched with the other half: that would double its bytes to save one request).
SMALL_GAP_BYTES = 64 << 10
MERGE_GAP_BYTES = 1 << 20
MAX_FETCH_BYTES = 16 << 20  # but no GET larger than this, so big shards download in parallel


def restore(
    storage: StorageBackend,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    *,
    verify: bool = True,
    model: dict[str, Any] | None = None,
    config_hash: str | None = None,
    concurrency: int = 8,
) -> int:
    """Fill ``tensors`` (FQN -> DTensor or plain tensor, already allocated) in place; return bytes read.

    Raises ``ForeignCheckpointError`` for another model or a tensor the checkpoint lacks or
    shapes differently, ``CorruptCheckpointError`` naming the object when a checksum fails.
    """
    check_compatible(manifest, model=model, config_hash=config_hash, uri=storage.uri)
    _check_destinations(manifest, tensors, storage.uri)
    return read_into(storage, manifest, tensors, verify=verify, concurrency=concurrency)


def read_into(
    storage: RangeSource,
    manifest: Manifest,
    tensors: dict[str, torch.Tensor],
    *,
    verify: bool = True,
    concurrency: int = 8,
) -> int:
    """``restore`` without its checks: the caller has matched every destination's name and shape.

    Also the path for indexes that are not committed checkpoints (a Hugging Face directory,
    ``checkpointing.hf_format``): their chunks carry no checksums, so they are read with
    ``verify=False``; so are peer-memory snapshots (``workers.peer_snapshots``), which
    ``storage`` may be. Each destination is cast to its own dtype on copy.
    """
    reader = ManifestStorageReader(storage, manifest, verify=verify, concurrency=concurrency)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(
                dict(tensors), storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=False), no_dist=True
            )
    except CheckpointException:
        if reader.failure is not None:  # DCP wraps errors raised inside read_data: give back ours
            raise reader.failure from None
        raise
    return reader.bytes_read


def _check_destinations(manifest: Manifest, tensors: dict[str, torch.Tensor], uri: str) -> None:
    missing = sorted(set(tensors) - set(manifest.tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ForeignCheckpointError(
            f"checkpoint {uri} step {manifest.step} has no tensor {shown}: it was written "
            "by another model or state layout"
        )
    for fqn, tensor in tensors.items():
        stored = manifest.tensors[fqn].shape
        if tuple(tensor.shape) != stored:
            raise ForeignCheckpointError(
                f"checkpoint {uri} step {manifest.step}: tensor {fqn!r} has shape "
                f"{list(stored)}, this job's has {list(tensor.shape)}"
            )


def manifest_metadata(manifest: Manifest, fqns: set[str] | None = None) -> Metadata:
    """DCP ``Metadata`` for (some of) the manifest's tensors; ``storage_data`` maps chunks to entries."""
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage_data = {}
    for fqn, index in manifest.tensors.items():
        if fqns is not None and fqn not in fqns:
            continue
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=getattr(torch, index.dtype)),
            size=torch.Size(index.shape),
            chunks=[
                ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)) for c in index.chunks
            ],
        )
        for chunk in index.chunks:
            storage_data[MetadataIndex(fqn, torch.Size(chunk.offsets))] = chunk
    return Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)


@dataclass
class _Need:
    """The rows of one stored chunk that this rank's read items touch."""

    chunk: ChunkEntry
    first_block: int
    last_block: int  # exclusive
    items: list[ReadItem]

    @property
    def row_bytes(self) -> int:
        return (
            (self.chunk.end - self.chunk.start) // self.chunk.sizes[0]
            if self.chunk.sizes and self.chunk.sizes[0]
            else 0
        )

    @property
    def byte_range(self) -> tuple[int, int]:
        if not self.chunk.sizes:
            return self.chunk.start, self.chunk.end
        step = self.chunk.block_rows * self.row_bytes
        return self.chunk.start + self.first_block * step, min(
            self.chunk.end, self.chunk.start + self.last_block * step
        )


class ManifestStorageReader(StorageReader):
    """A DCP storage reader over a meshpilot manifest: ranged GETs, block checksums, no pickle."""

    def __init__(self, storage: RangeSource, manifest: Manifest, *, verify: bool = True, concurrency: int = 8) -> None:
        super().__init__()
        self.storage = storage
        self.manifest = manifest
        self.verify = verify
        self.concurrency = max(1, concurrency)
        self.bytes_read = 0
        self.failure: CheckpointError | None = None
        self._metadata: Metadata | None = None

    # DCP call sequence on each rank: reset, read_metadata, set_up_storage_reader,
    # prepare_local_plan, prepare_global_plan (no_dist: this rank's plan only), read_data.
    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = manifest_metadata(self.manifest)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future:
        groups = _merge_ranges(self._needs(plan))
        try:
            with ThreadPoolExecutor(
                max_workers=min(self.concurrency, max(1, len(groups))), thread_name_prefix="meshpilot-restore"
            ) as pool:
                for done in [
                    pool.submit(self._fetch_group, key, start, end, members, planner)
                    for key, start, end, members in groups
                ]:
                    self.bytes_read += done.result()
        except CheckpointError as error:
            self.failure = error
            raise
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future

    def _needs(self, plan: LoadPlan) -> list[_Need]:
        by_chunk: dict[tuple[str, tuple[int, ...]], list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(
                    f"checkpoint entry {item.dest_index.fqn!r} is not a tensor; meshpilot checkpoints hold tensors only"
                )
            offset = item.storage_index.offset
            assert offset is not None, "DCP indexes a tensor's read item by its chunk's offset"
            by_chunk[(item.storage_index.fqn, tuple(offset))].append(item)
        metadata = self._metadata
        assert metadata is not None, "DCP calls set_up_storage_reader before read_data"
        needs = []
        for (fqn, offsets), items in by_chunk.items():
            chunk = metadata.storage_data[MetadataIndex(fqn, torch.Size(offsets))]
            if not chunk.sizes:
                needs.append(_Need(chunk=chunk, first_block=0, last_block=1, items=items))
                continue
            first_row = min(item.storage_offsets[0] for item in items)
            end_row = max(item.storage_offsets[0] + item.lengths[0] for item in items)
            first, last = first_row // chunk.block_rows, -(-end_row // chunk.block_rows)
            block_bytes = chunk.block_rows * ((chunk.end - chunk.start) // chunk.sizes[0])
            per_fetch = max(1, MAX_FETCH_BYTES // max(1, block_bytes))
            for start in range(first, last, per_fetch):
                needs.append(
                    _Need(chunk=chunk, first_block=start, last_block=min(last, start + per_fetch), items=items)
                )
        return needs

    @torch.no_grad()  # grad mode is per thread: without this a parameter's views are tracked by autograd,
    # and one thread's view of a parameter is refused once another thread has written into it
    def _fetch_group(self, key: str, start: int, end: int, members: list[_Need], planner: LoadPlanner) -> int:
        data = bytearray(self.storage.get_range(key, start, end))  # writable, so frombuffer shares it
        for need in members:
            begin, finish = need.byte_range
            view = memoryview(data)[begin - start : finish - start]
            if self.verify:
                self._verify(need, view)
            self._copy(need, view, planner)
        return end - start

    def _verify(self, need: _Need, view: memoryview) -> None:
        chunk = need.chunk
        step = chunk.block_rows * need.row_bytes if chunk.sizes else len(view)
        for number, block in enumerate(range(need.first_block, need.last_block)):
            piece = view[number * step : (number + 1) * step] if chunk.sizes else view
            digest = f"{CHECKSUM_ALGORITHM}:{hashlib.new(CHECKSUM_ALGORITHM, piece).hexdigest()}"
            if digest != chunk.checksums[block]:
                raise CorruptCheckpointError(
                    f"checkpoint data is corrupt: shard {self.storage.uri}/{chunk.key}, tensor {chunk.fqn!r} "
                    f"(block {block} at bytes {chunk.start + number * step}+) fails its {CHECKSUM_ALGORITHM} check; "
                    "restore an older step",
                    key=chunk.key,
                )

    def _copy(self, need: _Need, view: memoryview, planner: LoadPlanner) -> None:
        chunk = need.chunk
        dtype = getattr(torch, self.manifest.tensors[chunk.fqn].dtype)
        first_row = need.first_block * chunk.block_rows if chunk.sizes else 0
        rows = len(view) // need.row_bytes if chunk.sizes else 1
        stored = torch.frombuffer(view, dtype=dtype) if len(view) else torch.empty(0, dtype=dtype)
        stored = stored.view((rows, *chunk.sizes[1:]) if chunk.sizes else ())
        for item in need.items:
            source = stored
            target = planner.resolve_tensor(item).detach()
            if chunk.sizes:  # only the rows of this item that fall inside the fetched blocks
                begin = max(item.storage_offsets[0], first_row)
                end = min(item.storage_offsets[0] + item.lengths[0], first_row + rows)
                if begin >= end:
                    continue
                source = source.narrow(0, begin - first_row, end - begin)
                target = target.narrow(0, begin - item.storage_offsets[0], end - begin)
            for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                if dim > 0:
                    source = source.narrow(dim, offset, length)
            target.copy_(source)
            planner.commit_tensor(item, target)


def _merge_ranges(needs: list[_Need]) -> list[tuple[str, int, int, list[_Need]]]:
    """Group needs per object into as few GETs as possible without fetching much extra."""
    by_key: dict[str, list[_Need]] = defaultdict(list)
    for need in needs:
        by_key[need.chunk.key].append(need)
    groups = []
    for key, members in by_key.items():
        members.sort(key=lambda need: need.byte_range)
        current: list[_Need] = []
        start = end = 0
        for need in members:
            begin, finish = need.byte_range
            if current and _worth_merging(begin - end, finish - begin) and max(end, finish) - start <= MAX_FETCH_BYTES:
                current.append(need)
                end = max(end, finish)
                continue
            if current:
                groups.append((key, start, end, current))
            current, start, end = [need], begin, finish
        if current:
            groups.append((key, start, end, current))
    return groups


def _worth_merging(gap: int, wanted: int) -> bool:
    """Whether a GET should fetch ``gap`` unwanted bytes to reach the next ``wanted`` bytes."""
    return gap <= SMALL_GAP_BYTES or (gap <= MERGE_GAP_BYTES and 2 * gap <= wanted)
