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
    """Chunks of 64 bytes for buffers over 32 bytes, with the registrations recorded (CPU: no driver)."""
    monkeypatch.setattr(staging, "PIN_IN_ONE_CALL_MAX_BYTES", 32)
    monkeypatch.setattr(staging, "PIN_CHUNK_BYTES", 64)
    calls: list[tuple[int, int]] = []

    def register(storage: torch.Tensor, chunk_bytes: int) -> list[int]:
        calls.append((storage.numel(), chunk_bytes))
        return []

    return register, calls


def test_a_chunked_buffer_stages_the_same_bytes_as_a_one_piece_buffer(small_chunks):
    register, calls = small_chunks
    layout = plan_layout(TENSORS, rank=0, owns_plain_tensors=True)
    whole = HostBuffer(layout, pin_memory=False)
    chunked = HostBuffer(layout, pin_memory=True, register=register)
    assert calls == [(layout.size, 64)] and chunked.chunk_bytes == 64
    spanning = [s for s in layout.slots if s.begin // 64 != (s.end - 1) // 64]
    assert spanning, "the layout has slices across chunk boundaries"
    whole.stage(TENSORS)
    chunked.stage(TENSORS)
    assert bytes(chunked.memoryview()) == bytes(whole.memoryview())


def test_a_refused_registration_leaves_a_working_pageable_buffer(small_chunks):
    def refuse(storage: torch.Tensor, chunk_bytes: int) -> list[int]:
        raise RuntimeError("cudaHostRegister of 1 bytes failed with CUDA error 2")

    layout = plan_layout(TENSORS, rank=0, owns_plain_tensors=True)
    buffer = HostBuffer(layout, pin_memory=True, register=refuse)
    assert (buffer.pinned, buffer.chunk_bytes) == (False, None)
    buffer.stage(TENSORS)
    reference = HostBuffer(layout, pin_memory=False)
    reference.stage(TENSORS)
    assert bytes(buffer.memoryview()) == bytes(reference.memoryview())
