"""Staging on a rank: which slices this rank writes, and the reusable host buffer they are copied to.

Runs on every rank inside ``CheckpointWriter.save`` (the training loop's thread). The buffer is
laid out as the finished safetensors file (header, then every slice back to back), so copying
the local shards into it is the only work done while the loop waits; the background uploader
streams the buffer as it is.

Which rank writes what, without talking to the others (DESIGN.md: dedup without coordination):

* a DTensor's local chunk is written by the rank whose mesh coordinate is 0 on every mesh
  dimension where the placement is ``Replicate`` (one copy of each distinct slice) and, when
  the writer knows the global mesh, 0 on every global dimension the DTensor's own (sub-)mesh
  does not span except pipeline stages (a norm weight sharded over dp_shard only is copied
  across tp: one copy is written);
* a plain tensor is written where the caller says ``owns_plain_tensors=True``.

Chunk offsets come from torch.distributed.checkpoint's own helper (``torch_compat.chunk_list``), the
same one its planner uses when it reads, so writer and reader agree on every layout, including
FSDP2-over-TP strided shards and uneven shards.
"""

from __future__ import annotations

import bisect
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from checkpointing.errors import CheckpointError
from checkpointing.shardfile import build_header
from checkpointing.spec import DTYPES, TensorEntry, block_count, block_rows
from checkpointing.torch_compat import chunk_list, local_tensor_shape

log = logging.getLogger("meshpilot.checkpoint")


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
        return [
            (start, min(start + step, self.end))
            for start in range(self.begin, self.begin + block_count(self.sizes, self.block_rows) * step, step)
        ]


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


@dataclass(frozen=True)
class Placement:
    """Where this rank sits in the job's global mesh, for deciding who writes replicated slices.

    ``coordinate`` and ``layout`` describe the global DeviceMesh (``mesh.get_coordinate()``,
    ``mesh.mesh.tolist()``); ``stage_dims`` are its dimensions whose coordinates hold *different*
    tensors (pipeline stages), not copies.
    """

    coordinate: tuple[int, ...]
    layout: torch.Tensor
    stage_dims: tuple[int, ...] = ()

    @classmethod
    def of(cls, mesh, *, stage_dims: tuple[str, ...] = ("pp",)) -> Placement:
        names = mesh.mesh_dim_names or ()
        return cls(
            coordinate=tuple(mesh.get_coordinate()),
            layout=mesh.mesh.clone(),
            stage_dims=tuple(names.index(name) for name in stage_dims if name in names),
        )

    def writes_copy_of(self, tensor_mesh_ranks: frozenset[int]) -> bool:
        """True when this rank writes a tensor living on a sub-mesh with these ranks.

        The sub-mesh is implicitly replicated along every global dimension it does not span
        (a norm weight sharded by FSDP over dp_shard is copied across tp); only the copy at
        coordinate 0 of those dimensions is written.
        """
        for dim, size in enumerate(self.layout.shape):
            if size == 1 or dim in self.stage_dims or self.coordinate[dim] == 0:
                continue
            neighbour = list(self.coordinate)
            neighbour[dim] = 0
            if int(self.layout[tuple(neighbour)]) not in tensor_mesh_ranks:
                return False  # the sub-mesh does not span this dim: the copy at 0 writes it
        return True


def owned_chunks(
    tensor: torch.Tensor, *, owns_plain_tensors: bool, placement: Placement | None = None
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The (offsets, sizes) of the local slices this rank writes for ``tensor`` (maybe none)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        coordinate = tensor.device_mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the tensor's mesh
            return []
        for dim, placement_of_dim in enumerate(tensor.placements):
            if placement_of_dim.is_partial():
                raise CheckpointError(
                    f"a DTensor with a Partial placement cannot be saved (mesh dim {dim}); reduce it first"
                )
            if placement_of_dim.is_replicate() and coordinate[dim] != 0:
                return []
        if placement is not None and not placement.writes_copy_of(_mesh_ranks(tensor.device_mesh)):
            return []
    elif not owns_plain_tensors:
        return []
    chunks = []
    for chunk in chunk_list(tensor):
        sizes = tuple(int(s) for s in chunk.sizes)
        if math.prod(sizes) or not sizes:  # empty slices of uneven shards hold nothing to write
            chunks.append((tuple(int(o) for o in chunk.offsets), sizes))
    return chunks


# Keyed by the mesh object's identity, never by DeviceMesh equality: a sub-mesh compares (and
# hashes) equal to its sibling on another pipeline stage (same rank map, layout and names), so a
# rank that held stage 1 in an earlier generation and stage 0 now would be handed stage 1's ranks
# while the old mesh lives on, and would write none of its slices (every later save torn). An
# entry leaves with its mesh: the cache keeps no DeviceMesh (nor its process groups) alive, and
# an id is never reused while its entry is here.
_MESH_RANKS: dict[int, frozenset[int]] = {}


def _mesh_ranks(mesh) -> frozenset[int]:
    ranks = _MESH_RANKS.get(id(mesh))
    if ranks is None:
        ranks = _MESH_RANKS[id(mesh)] = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
        weakref.finalize(mesh, _MESH_RANKS.pop, id(mesh), None)
    return ranks


def layout_key(tensors: dict[str, torch.Tensor], owns_plain_tensors: bool) -> tuple:
    """What decides a layout, cheap to compute: names, dtypes, shapes, meshes and placements.

    Meshes enter by identity; ``LayoutCache`` keeps only weak references to them.
    """
    from torch.distributed.tensor import DTensor

    parts: list[tuple] = [(owns_plain_tensors,)]
    for fqn in sorted(tensors):
        tensor = tensors[fqn]
        if isinstance(tensor, DTensor):
            parts.append(
                (
                    fqn,
                    tensor.dtype,
                    tuple(tensor.shape),
                    id(tensor.device_mesh),
                    tuple(tensor.placements),
                    local_tensor_shape(tensor),
                )
            )
        else:
            parts.append((fqn, getattr(tensor, "dtype", None), tuple(getattr(tensor, "shape", ()))))
    return tuple(parts)


class LayoutCache:
    """Reuses the last layout while the state keeps its shapes and meshes (saves ~10 ms per save)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._meshes: list[weakref.ref] = []
        self._layout: Layout | None = None

    def get(
        self, tensors: dict[str, torch.Tensor], *, rank: int, owns_plain_tensors: bool, placement: Placement | None
    ) -> Layout:
        from torch.distributed.tensor import DTensor

        key = layout_key(tensors, owns_plain_tensors)
        if key == self._key and self._layout is not None and all(ref() is not None for ref in self._meshes):
            return self._layout
        layout = plan_layout(tensors, rank=rank, owns_plain_tensors=owns_plain_tensors, placement=placement)
        meshes = {id(t.device_mesh): t.device_mesh for t in tensors.values() if isinstance(t, DTensor)}
        self._key, self._layout = key, layout
        self._meshes = [weakref.ref(mesh) for mesh in meshes.values()]
        return layout


def local_data(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def plan_layout(
    tensors: dict[str, torch.Tensor], *, rank: int, owns_plain_tensors: bool, placement: Placement | None = None
) -> Layout:
    """The shard-file layout for this rank's slices of ``tensors`` (FQN -> plain tensor or DTensor)."""
    entries = []
    pieces = []
    for fqn in sorted(tensors):
        tensor = tensors[fqn]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"checkpoint entry {fqn!r} is a {type(tensor).__name__}, not a tensor; put non-tensor state in extra="
            )
        dtype = dtype_name(tensor.dtype)
        entries.append(TensorEntry(fqn=fqn, shape=tuple(int(d) for d in tensor.shape), dtype=dtype))
        for offsets, sizes in owned_chunks(tensor, owns_plain_tensors=owns_plain_tensors, placement=placement):
            local_shape = tuple(local_data(tensor).shape)
            if local_shape != sizes:
                raise CheckpointError(f"{fqn!r}: local shard of shape {local_shape} does not match its chunk {sizes}")
            whole = offsets == (0,) * len(offsets) and sizes == tuple(tensor.shape)
            name = fqn if whole else f"{fqn}@{','.join(map(str, offsets))}"
            pieces.append((fqn, name, dtype, offsets, sizes))
    # Largest elements first: every slice then starts aligned to its element size.
    pieces.sort(key=lambda piece: (-DTYPES[piece[2]][1], piece[1]))
    header, placed = build_header(
        [(name, dtype, sizes) for _, name, dtype, _, sizes in pieces], {"format": "meshpilot-shard", "rank": str(rank)}
    )
    slots = tuple(
        Slot(
            fqn=fqn,
            name=name,
            dtype=dtype,
            offsets=offsets,
            sizes=sizes,
            begin=entry.begin,
            end=entry.end,
            block_rows=block_rows(sizes, dtype),
        )
        for (fqn, name, dtype, offsets, sizes), entry in zip(pieces, placed)
    )
    signature = tuple((s.fqn, s.dtype, s.offsets, s.sizes) for s in slots) + tuple(entries)
    return Layout(signature=signature, header=header, slots=slots, tensors=tuple(entries))


# Page-locking host memory runs under the NVIDIA driver's process-wide locks. One call for a whole
# large buffer holds them until every page is locked: 17 GiB (a 1.5B-parameter model's parameters
# and AdamW state, one snapshot buffer) took 12.7 s on an H100, and the rank answered no heartbeat
# meanwhile, so the driver declared it unresponsive. Larger buffers are therefore touched first
# (outside the locks) and registered with the driver in chunks, each a short hold.
PIN_IN_ONE_CALL_MAX_BYTES = 2 * 2**30
PIN_CHUNK_BYTES = 2**30
# Registrations start on page boundaries so that no two share a page (the driver locks whole
# pages, and a page registered twice is refused).
PAGE_BYTES = 4096


def chunk_offsets(base: int, size: int, chunk_bytes: int) -> list[int]:
    """Offsets from ``base`` where each registration of a ``size``-byte buffer starts: 0, then a
    page boundary about every ``chunk_bytes``."""
    offsets = [0]
    while True:
        end = base + offsets[-1] + chunk_bytes
        following = (end + PAGE_BYTES - 1) // PAGE_BYTES * PAGE_BYTES - base
        if following >= size:
            return offsets
        offsets.append(following)


def register_pinned(storage: torch.Tensor, offsets: list[int]) -> list[int]:
    """Page-lock ``storage`` (uint8, host) one registration per ``offsets`` entry; returns their
    addresses for ``unregister_pinned``. Raises ``RuntimeError`` (after undoing its registrations)
    if the driver refuses one."""
    cudart = torch.cuda.cudart()
    base, size = storage.data_ptr(), storage.numel()
    registered: list[int] = []
    for start, end in zip(offsets, [*offsets[1:], size]):
        error = int(cudart.cudaHostRegister(base + start, end - start, 0))
        if error:
            unregister_pinned(registered)
            raise RuntimeError(f"cudaHostRegister of {end - start} bytes failed with CUDA error {error}")
        registered.append(base + start)
    return registered


def unregister_pinned(addresses: list[int]) -> None:
    """Undo ``register_pinned`` (before the memory is freed; errors at interpreter exit are moot)."""
    if addresses and torch.cuda.is_initialized():
        cudart = torch.cuda.cudart()
        for address in addresses:
            cudart.cudaHostUnregister(address)


# Page-locks a buffer in registrations starting at the given offsets (``register_pinned``, or a test's fake).
Register = Callable[[torch.Tensor, list[int]], list[int]]


def pinned_bytes(size: int) -> torch.Tensor:
    """``size`` bytes of host memory page-locked in one call (CUDA's pinned allocator)."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


class HostBytes:
    """A host byte buffer that device-to-host copies land in, page-locked when ``pin_memory``.

    Page-locked so that device-to-host copies run at the link's rate (about 51 GiB/s on an H100,
    against 1.1 GiB/s into pageable memory): in one call up to ``PIN_IN_ONE_CALL_MAX_BYTES``, in
    registrations of about ``PIN_CHUNK_BYTES`` on page boundaries above it (see the comment above
    ``PIN_IN_ONE_CALL_MAX_BYTES``); ``copy_in`` never lets a copy span two registrations. A driver
    that refuses a registration leaves the buffer pageable (correct, only slower). The
    registrations are undone when the memory itself is freed: once the last tensor viewing
    ``storage`` is gone, whoever holds the views. Runs on a rank, in the thread that copies.
    """

    def __init__(self, size: int, *, pin_memory: bool, register: Register | None = None) -> None:
        self.size = size
        self.pinned = pin_memory
        # Where each page-locked registration starts (offsets), when the buffer is registered in chunks.
        self.chunk_starts: list[int] | None = None
        if not pin_memory:
            self.storage = torch.empty(size, dtype=torch.uint8)
        elif size <= PIN_IN_ONE_CALL_MAX_BYTES:
            self.storage = pinned_bytes(size)
        else:
            self.storage = torch.zeros(size, dtype=torch.uint8)  # every page touched, outside the locks
            offsets = chunk_offsets(self.storage.data_ptr(), size, PIN_CHUNK_BYTES)
            try:
                # On the storage, not on this object: views of it may outlive it (local_shards).
                addresses = (register or register_pinned)(self.storage, offsets)
                weakref.finalize(self.storage.untyped_storage(), unregister_pinned, addresses)
                self.chunk_starts = offsets
            except RuntimeError as error:  # correct, only slower: copies into pageable memory
                log.warning("host buffer of %d bytes stays pageable: %s", size, error)
                self.pinned = False

    def view(self, begin: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes from ``begin`` as a tensor of ``dtype`` and ``shape`` (``begin`` aligned to its element size)."""
        return self.storage[begin : begin + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def copy_in(self, view: torch.Tensor, begin: int, source: torch.Tensor) -> None:
        """Copy ``source`` into ``view``, this buffer's bytes from ``begin``; non-blocking into
        page-locked memory (the caller synchronises the device once after its copies)."""
        end = begin + view.numel() * view.element_size()
        starts = self.chunk_starts
        if starts is None or bisect.bisect_right(starts, begin) == bisect.bisect_right(starts, end - 1):
            view.copy_(source, non_blocking=self.pinned)
        else:
            self._copy_across_chunks(begin, end, source, starts)

    def _copy_across_chunks(self, begin: int, end: int, source: torch.Tensor, starts: list[int]) -> None:
        """A slice whose bytes span registrations is copied one registration's part at a time (each
        part lies in one page-locked range, so each is a direct transfer)."""
        data = source.contiguous().view(-1).view(torch.uint8)
        ends = [*starts[1:], self.size]
        position = begin
        while position < end:
            part_end = min(end, ends[bisect.bisect_right(starts, position) - 1])
            part = data[position - begin : part_end - begin]
            self.storage[position:part_end].copy_(part, non_blocking=self.pinned)
            position = part_end


def copy_to_host(
    tensors: dict[str, torch.Tensor], *, pin_memory: bool, register: Register | None = None
) -> dict[str, torch.Tensor]:
    """Host copies of plain ``tensors``, as views of one ``HostBytes`` buffer (each at an offset
    aligned to its element size), page-locked when ``pin_memory`` (in chunks above
    ``PIN_IN_ONE_CALL_MAX_BYTES``). The views keep the buffer alive. Runs on a rank; returns once
    the bytes are in host memory."""
    offsets: dict[str, int] = {}
    size = 0
    for name, tensor in tensors.items():
        size = -(-size // tensor.element_size()) * tensor.element_size()  # aligned for its dtype
        offsets[name] = size
        size += tensor.numel() * tensor.element_size()
    buffer = HostBytes(size, pin_memory=pin_memory, register=register)
    copies: dict[str, torch.Tensor] = {}
    on_device = False
    for name, tensor in tensors.items():
        copies[name] = buffer.view(offsets[name], tensor.dtype, tuple(tensor.shape))
        buffer.copy_in(copies[name], offsets[name], tensor)
        on_device = on_device or tensor.device.type != "cpu"
    if on_device and buffer.pinned:
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return copies


class HostBuffer:
    """A host copy of one shard file, reused across saves while the layout stays the same: the
    file's bytes in one ``HostBytes`` (page-locked when ``pin_memory``, in chunks when large)."""

    def __init__(self, layout: Layout, *, pin_memory: bool, register: Register | None = None) -> None:
        self.layout = layout
        self.bytes = HostBytes(layout.size, pin_memory=pin_memory, register=register)
        self.storage = self.bytes.storage
        self.storage[: len(layout.header)].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        self.views = [self.bytes.view(slot.begin, getattr(torch, slot.dtype), slot.sizes) for slot in layout.slots]

    @property
    def pinned(self) -> bool:
        return self.bytes.pinned

    @property
    def chunk_starts(self) -> list[int] | None:
        return self.bytes.chunk_starts

    def stage(self, tensors: dict[str, torch.Tensor], *, wait: bool = True) -> None:
        """Copy every owned slice into the buffer; returns once the bytes are in host memory, or,
        without ``wait``, once the copies from a device are queued on the current stream (the
        caller waits for them: peer-memory snapshots record an event there)."""
        on_device = False
        for slot, view in zip(self.layout.slots, self.views):
            source = local_data(tensors[slot.fqn]).detach()
            on_device = on_device or source.device.type != "cpu"
            self.bytes.copy_in(view, slot.begin, source)
        if wait and on_device and self.pinned:
            torch.cuda.synchronize()  # non-blocking copies must land before the optimizer moves on

    def memoryview(self) -> memoryview:
        # numpy declares ndarray.__buffer__ only for Python >= 3.12; every ndarray has the buffer protocol.
        return memoryview(self.storage.numpy()).cast("B")  # type: ignore[arg-type]
