"""The reader fetches only the checksum blocks a rank's slice needs, and verifies what it reads.

A fake process group lets this one process act as rank 1 of 4 (restore needs no collective).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from checkpointing.commit import CommitCoordinator
from checkpointing.errors import CorruptCheckpointError
from checkpointing.local import LocalStorage
from checkpointing.reader import load_manifest, restore
from checkpointing.writer import CheckpointWriter

ROWS, COLS = 4096, 512  # 8 MiB of float32: two 4 MiB checksum blocks of 2048 rows


class CountingStorage(LocalStorage):
    def __init__(self, root) -> None:
        super().__init__(root, fsync=False)
        self.ranges: list[tuple[str, int, int]] = []

    def get_range(self, key, start, end):
        self.ranges.append((key, start, end))
        return super().get_range(key, start, end)


@pytest.fixture
def fake_rank_1_of_4():
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def saved(tmp_path):
    storage = CountingStorage(tmp_path)
    coordinator = CommitCoordinator(storage, world_size=1, mesh={}, config_hash=None, model={}, keep_last=1)
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    writer = CheckpointWriter(storage, rank=0, report=coordinator.on_report)
    writer.save(1, {"w": full, "b": torch.arange(7.0)}, extra={}, owns_plain_tensors=True)
    writer.close()
    return storage, full


def sharded_destination(mesh, placement) -> DTensor:
    local_rows = ROWS // 4 if placement == Shard(0) else ROWS
    local_cols = COLS // 4 if placement == Shard(1) else COLS
    return DTensor.from_local(
        torch.zeros(local_rows, local_cols),
        mesh,
        [placement],
        run_check=False,
        shape=torch.Size([ROWS, COLS]),
        stride=(COLS, 1),
    )


def test_row_shard_reads_only_its_block(saved, fake_rank_1_of_4):
    storage, full = saved
    manifest = load_manifest(storage)
    destination = sharded_destination(fake_rank_1_of_4, Shard(0))
    storage.ranges.clear()
    read = restore(storage, manifest, {"w": destination})
    assert torch.equal(destination.to_local(), full[1024:2048])  # rank 1's rows
    assert read == 4 << 20  # one 4 MiB block of 8 MiB
    assert len(storage.ranges) == 1


def test_column_shard_needs_every_row(saved, fake_rank_1_of_4):
    storage, full = saved
    destination = sharded_destination(fake_rank_1_of_4, Shard(1))
    read = restore(storage, load_manifest(storage), {"w": destination})
    assert torch.equal(destination.to_local(), full[:, 128:256])
    assert read == 8 << 20


def test_replicated_destination_and_plain_tensor(saved, fake_rank_1_of_4):
    storage, full = saved
    destination = sharded_destination(fake_rank_1_of_4, Replicate())
    bias = torch.zeros(7)
    restore(storage, load_manifest(storage), {"w": destination, "b": bias})
    assert torch.equal(destination.to_local(), full) and torch.equal(bias, torch.arange(7.0))


def test_corrupt_block_raises_naming_the_shard(saved, fake_rank_1_of_4):
    storage, _ = saved
    manifest = load_manifest(storage)
    chunk = manifest.tensors["w"].chunks[0]
    path = storage.root / chunk.key
    data = bytearray(path.read_bytes())
    data[chunk.start + (3 << 20)] ^= 1  # inside block 0 (rows 0-2047)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=rf"shard .*{chunk.key}, tensor 'w' \(block 0"):
        restore(storage, manifest, {"w": sharded_destination(fake_rank_1_of_4, Shard(0))})
    # The other block is intact: a column of ranks that only needs rows 2048+ would not notice;
    # and with verify=False (the user's explicit choice) the bytes load unchecked.
    restore(storage, manifest, {"w": sharded_destination(fake_rank_1_of_4, Shard(0))}, verify=False)


def test_large_chunks_download_in_parallel_pieces(saved, monkeypatch):
    import checkpointing.reader as reader

    storage, full = saved
    monkeypatch.setattr(reader, "MAX_FETCH_BYTES", 4 << 20)
    whole = torch.zeros(ROWS, COLS)
    storage.ranges.clear()
    restore(storage, load_manifest(storage), {"w": whole})
    assert torch.equal(whole, full)
    assert sorted(end - start for _, start, end in storage.ranges) == [4 << 20, 4 << 20]


def _save_row_halves(storage, full):
    """Save ``full`` as dp_shard=2 would: rank 0 and rank 1 each write their half of the rows."""
    coordinator = CommitCoordinator(
        storage, world_size=2, mesh={"dp_shard": 2}, config_hash=None, model={}, keep_last=1
    )
    for rank in range(2):
        dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (2,))
            half = full.chunk(2)[rank].clone()
            shard = DTensor.from_local(half, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
            writer = CheckpointWriter(storage, rank=rank, report=coordinator.on_report)
            writer.save(1, {"w": shard}, extra={}, owns_plain_tensors=True)
            writer.close()
        finally:
            dist.destroy_process_group()


def test_restore_threads_share_a_trainable_parameter(tmp_path, monkeypatch):
    """A dp_shard=2 checkpoint restored into a column-sharded parameter: one download thread per row half,
    both writing into the same local tensor. One resolves its view, the other copies, then the first
    narrows. Regression: threads do not inherit the caller's no_grad, and with grad mode on autograd
    refused the first view because its base had changed in place meanwhile."""
    import checkpointing.reader as reader

    storage = LocalStorage(tmp_path, fsync=False)
    full = torch.randn(ROWS // 2, COLS, generator=torch.Generator().manual_seed(0))
    _save_row_halves(storage, full)
    copied = threading.Event()
    first = threading.Lock()

    class InterleavingPlanner(reader.DefaultLoadPlanner):
        def transform_tensor(self, read_item, tensor):
            if first.acquire(blocking=False):  # the first thread holds its view until the other has copied
                assert copied.wait(timeout=30)
            return super().transform_tensor(read_item, tensor)

        def commit_tensor(self, read_item, tensor):
            copied.set()

    monkeypatch.setattr(reader, "DefaultLoadPlanner", InterleavingPlanner)
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        destination = DTensor.from_local(
            torch.zeros(ROWS // 2, COLS // 4),
            init_device_mesh("cpu", (4,)),
            [Shard(1)],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
        parameter = torch.nn.Parameter(destination)
        restore(storage, load_manifest(storage), {"w": parameter}, concurrency=2)
        assert torch.equal(parameter.to_local(), full[:, 128:256])
    finally:
        dist.destroy_process_group()
