"""Host buffers page-locked in chunks (large GPU snapshots and checkpoints) hold the same bytes as
one-piece buffers: a slice that spans two chunks is copied a chunk's part at a time."""

from __future__ import annotations

import pytest
import torch

from checkpointing import staging
from checkpointing.staging import HostBuffer, plan_layout

TENSORS = {
    "a": torch.arange(10, dtype=torch.float32),
    "b": torch.arange(37, dtype=torch.bfloat16).reshape(37, 1) * 3,
    "c": torch.randn(5, 7, generator=torch.Generator().manual_seed(0)),
    "d": torch.tensor(7.0),
}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of about 64 bytes on 16-byte "pages" for buffers over 32 bytes, with the registrations
    recorded (CPU: no driver)."""
    monkeypatch.setattr(staging, "PIN_IN_ONE_CALL_MAX_BYTES", 32)
    monkeypatch.setattr(staging, "PIN_CHUNK_BYTES", 64)
    monkeypatch.setattr(staging, "PAGE_BYTES", 16)
    calls: list[tuple[int, list[int]]] = []

    def register(storage: torch.Tensor, offsets: list[int]) -> list[int]:
        calls.append((storage.data_ptr(), offsets))
        return []

    return register, calls


def test_registrations_start_on_page_boundaries_about_a_chunk_apart():
    assert staging.chunk_offsets(base=4096 * 10 + 64, size=3 * 2**30, chunk_bytes=2**30) == [
        0,
        2**30 + 4096 - 64,
        2 * 2**30 + 4096 - 64,
    ]
    assert staging.chunk_offsets(base=4096, size=2**30, chunk_bytes=2**30) == [0]


def test_a_chunked_buffer_stages_the_same_bytes_as_a_one_piece_buffer(small_chunks):
    register, calls = small_chunks
    layout = plan_layout(TENSORS, rank=0, owns_plain_tensors=True)
    whole = HostBuffer(layout, pin_memory=False)
    chunked = HostBuffer(layout, pin_memory=True, register=register)
    [(base, offsets)] = calls
    assert chunked.chunk_starts == offsets and len(offsets) > 2
    assert all((base + offset) % 16 == 0 for offset in offsets[1:])
    spanning = [s for s in layout.slots if any(s.begin < offset < s.end for offset in offsets)]
    assert spanning, "the layout has slices across registrations"
    whole.stage(TENSORS)
    chunked.stage(TENSORS)
    assert bytes(chunked.memoryview()) == bytes(whole.memoryview())


def test_a_refused_registration_leaves_a_working_pageable_buffer(small_chunks):
    def refuse(storage: torch.Tensor, offsets: list[int]) -> list[int]:
        raise RuntimeError("cudaHostRegister of 64 bytes failed with CUDA error 712")

    layout = plan_layout(TENSORS, rank=0, owns_plain_tensors=True)
    buffer = HostBuffer(layout, pin_memory=True, register=refuse)
    assert (buffer.pinned, buffer.chunk_starts) == (False, None)
    buffer.stage(TENSORS)
    reference = HostBuffer(layout, pin_memory=False)
    reference.stage(TENSORS)
    assert bytes(buffer.memoryview()) == bytes(reference.memoryview())


def test_host_copies_above_the_threshold_are_registered_in_chunks_on_page_boundaries(small_chunks):
    register, calls = small_chunks
    copies = staging.copy_to_host(TENSORS, pin_memory=True, register=register)
    [(base, offsets)] = calls  # one buffer for every tensor, registered once, in chunks
    assert len(offsets) > 2 and all((base + offset) % 16 == 0 for offset in offsets[1:])
    assert {copy.untyped_storage().data_ptr() for copy in copies.values()} == {base}
    spans = [
        name
        for name, copy in copies.items()
        if any(0 < offset - (copy.data_ptr() - base) < copy.nbytes for offset in offsets)
    ]
    assert spans, "some tensor's bytes lie across two registrations"
    for name, tensor in TENSORS.items():
        assert copies[name].dtype == tensor.dtype and copies[name].data_ptr() % tensor.element_size() == 0
        assert torch.equal(copies[name], tensor)


def test_host_copies_below_the_threshold_are_page_locked_in_one_call(monkeypatch):
    registered, one_call = [], []

    def pinned_bytes(size: int) -> torch.Tensor:  # CPU: no pinned allocator
        one_call.append(size)
        return torch.empty(size, dtype=torch.uint8)

    monkeypatch.setattr(staging, "pinned_bytes", pinned_bytes)
    copies = staging.copy_to_host(TENSORS, pin_memory=True, register=lambda s, o: registered.append(o) or [])
    assert registered == [] and len(one_call) == 1
    assert all(torch.equal(copies[name], tensor) for name, tensor in TENSORS.items())
