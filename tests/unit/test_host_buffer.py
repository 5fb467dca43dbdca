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
