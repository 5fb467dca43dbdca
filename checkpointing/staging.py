"""Staging on a rank: which slices this rank writes, and the reusable host buffer they are copied to.

Runs on every rank inside ``CheckpointWriter.save`` (the training loop's thread). The buffer is
laid out as the finished safetensors file (header, then every slice back to back), so copying
the local shards into it is the only work done while the loop waits; the background uploader
streams the buffer as it is.

Which rank writes what, without talking to the others (DESIGN.md: dedup without coordination):

* a DTensor's local chunk is written by the rank whose mesh coordinate is 0 on every mesh
  dimension where the placement is ``Replicate`` (one copy of each distinct slice);
* a plain tensor is written where the caller says ``owns_plain_tensors=True``.

Chunk offsets come from torch.distributed.checkpoint's own helper (``_create_chunk_list``), the
same one its planner uses when it reads, so writer and reader agree on every layout, including
FSDP2-over-TP strided shards and uneven shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from checkpointing.errors import CheckpointError
from checkpointing.shardfile import build_header
from checkpointing.spec import DTYPES, TensorEntry, block_count, block_rows


@dataclass(frozen=True)
class Slot:
    """One slice this rank writes, and where it sits in the shard file."""

    fqn: str
    name: str  # the tensor's name inside the safetensors file
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    begin: int  # absolute byte range in the file
    end: int
    block_rows: int

    def blocks(self) -> list[tuple[int, int]]:
        """Absolute byte ranges of this slot's checksum blocks."""
        if not self.sizes:
            return [(self.begin, self.end)]
        row_bytes = (self.end - self.begin) // self.sizes[0]
        step = self.block_rows * row_bytes
        return [(start, min(start + step, self.end))
                for start in range(self.begin, self.begin + block_count(self.sizes, self.block_rows) * step, step)]


@dataclass(frozen=True)
class Layout:
    """The shard file this rank writes for a given set of tensors (reused while they keep their shapes)."""

    signature: tuple
    header: bytes
    slots: tuple[Slot, ...]
    tensors: tuple[TensorEntry, ...]  # every tensor this rank holds, owned or not

    @property
    def size(self) -> int:
        return self.slots[-1].end if self.slots else len(self.header)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise CheckpointError(f"tensors of dtype {name} cannot be checkpointed; supported: {', '.join(DTYPES)}")
    return name


def owned_chunks(tensor: torch.Tensor, *, owns_plain_tensors: bool) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) of the local slices this rank writes for ``tensor`` (maybe none)."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the tensor's mesh
            return []
        for dim, placement in enumerate(tensor.placements):
            if placement.is_partial():
                raise CheckpointError(f"a DTensor with a Partial placement cannot be saved (mesh dim {dim}); "
                                      "reduce it first")
            if placement.is_replicate() and coordinate[dim] != 0:
                return []
    elif not owns_plain_tensors:
        return []
    chunks = []
    for chunk in _create_chunk_list(tensor):
        sizes = tuple(int(s) for s in chunk.sizes)
        if math.prod(sizes) or not sizes:  # empty slices of uneven shards hold nothing to write
            chunks.append((tuple(int(o) for o in chunk.offsets), sizes))
    return chunks


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def plan_layout(tensors: dict[str, torch.Tensor], *, rank: int, owns_plain_tensors: bool) -> Layout:
    """The shard-file layout for this rank's slices of ``tensors`` (FQN -> plain tensor or DTensor)."""
    entries = []
    pieces = []
    for fqn in sorted(tensors):
        tensor = tensors[fqn]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"checkpoint entry {fqn!r} is a {type(tensor).__name__}, not a tensor; "
                                  "put non-tensor state in extra=")
        dtype = dtype_name(tensor.dtype)
        entries.append(TensorEntry(fqn=fqn, shape=tuple(int(d) for d in tensor.shape), dtype=dtype))
        for offsets, sizes in owned_chunks(tensor, owns_plain_tensors=owns_plain_tensors):
            local_shape = tuple(local_data(tensor).shape)
            if local_shape != sizes:
                raise CheckpointError(f"{fqn!r}: local shard of shape {local_shape} does not match its "
                                      f"chunk {sizes}")
            whole = offsets == (0,) * len(offsets) and sizes == tuple(tensor.shape)
            name = fqn if whole else f"{fqn}@{','.join(map(str, offsets))}"
            pieces.append((fqn, name, dtype, offsets, sizes))
    # Largest elements first: every slice then starts aligned to its element size.
    pieces.sort(key=lambda piece: (-DTYPES[piece[2]][1], piece[1]))
    header, placed = build_header([(name, dtype, sizes) for _, name, dtype, _, sizes in pieces],
                                  {"format": "meshpilot-shard", "rank": str(rank)})
    slots = tuple(
        Slot(fqn=fqn, name=name, dtype=dtype, offsets=offsets, sizes=sizes, begin=entry.begin, end=entry.end,
             block_rows=block_rows(sizes, dtype))
        for (fqn, name, dtype, offsets, sizes), entry in zip(pieces, placed)
    )
    signature = tuple((s.fqn, s.dtype, s.offsets, s.sizes) for s in slots) + tuple(entries)
    return Layout(signature=signature, header=header, slots=slots, tensors=tuple(entries))


class HostBuffer:
    """A host copy of one shard file, reused across saves while the layout stays the same."""

    def __init__(self, layout: Layout, *, pin_memory: bool) -> None:
        self.layout = layout
        self.storage = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pin_memory)
        self.pinned = pin_memory
        self.storage[: len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self.views = [self._view(slot) for slot in layout.slots]

    def _view(self, slot: Slot) -> torch.Tensor:
        flat = self.storage[slot.begin:slot.end].view(getattr(torch, slot.dtype))
        return flat.view(slot.sizes)

    def stage(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy every owned slice into the buffer; returns once the bytes are in host memory."""
        on_device = False
        for slot, view in zip(self.layout.slots, self.views):
            source = local_data(tensors[slot.fqn])
            on_device = on_device or source.device.type != "cpu"
            view.copy_(source.detach(), non_blocking=self.pinned)
        if on_device and self.pinned:
            torch.cuda.synchronize()  # non-blocking copies must land before the optimizer moves on

    def memoryview(self) -> memoryview:
        return memoryview(self.storage.numpy()).cast("B")
