"""The rank-side writer on a local directory: staging semantics, back-pressure, retries, reports."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from checkpointing.commit import CommitCoordinator
from checkpointing.local import LocalStorage
from checkpointing.reader import load_manifest, restore
from checkpointing.spec import FailureReport
from checkpointing.writer import CheckpointWriter


class GatedStorage(LocalStorage):
    """Local storage whose uploads wait for a gate, and can fail a number of times first."""

    def __init__(self, root, *, failures: int = 0) -> None:
        super().__init__(root, fsync=False)
        self.gate = threading.Event()
        self.gate.set()
        self.failures = failures
        self.calls = 0

    def put_stream(self, key, pieces, *, size=None):
        self.calls += 1
        assert self.gate.wait(30)
        if self.failures:
            self.failures -= 1
            raise OSError("connection reset by peer")
        return super().put_stream(key, pieces, size=size)


def coordinator_for(storage, world_size: int = 1) -> CommitCoordinator:
    return CommitCoordinator(
        storage, world_size=world_size, mesh={"dp_shard": world_size}, config_hash="h", model={"dim": 8}, keep_last=10
    )


def test_save_returns_before_upload_and_stages_a_snapshot(tmp_path):
    storage = GatedStorage(tmp_path)
    coordinator = coordinator_for(storage)
    writer = CheckpointWriter(storage, rank=0, report=coordinator.on_report)
    weights = torch.randn(256, 64)
    snapshot = weights.clone()
    storage.gate.clear()  # the upload cannot progress
    stall = writer.save(1, {"w": weights}, extra={"cursor": 1}, owns_plain_tensors=True)
    assert stall < 1.0 and coordinator.committed_steps == []
    weights.add_(1.0)  # the optimizer moves on while the upload is pending
    storage.gate.set()
    writer.close()
    assert coordinator.committed_steps == [1]
    restored = {"w": torch.zeros(256, 64)}
    restore(storage, load_manifest(storage), restored)
    assert torch.equal(restored["w"], snapshot)


def test_back_pressure_blocks_the_next_save_and_reuses_the_buffer(tmp_path):
    storage = GatedStorage(tmp_path)
    coordinator = coordinator_for(storage)
    writer = CheckpointWriter(storage, rank=0, report=coordinator.on_report, max_in_flight=1)
    state = {"w": torch.randn(128, 32)}
    storage.gate.clear()
    writer.save(1, state, extra={}, owns_plain_tensors=True)
    threading.Timer(0.4, storage.gate.set).start()
    stall = writer.save(2, state, extra={}, owns_plain_tensors=True)  # waits for step 1's upload
    assert stall >= 0.3
    writer.wait()
    buffer = writer._free[0]
    writer.save(3, state, extra={}, owns_plain_tensors=True)
    writer.close()
    assert writer._free == [buffer]  # the same host buffer served every save
    assert coordinator.committed_steps == [1, 2, 3]


def test_failed_uploads_are_retried_then_reported(tmp_path):
    storage = GatedStorage(tmp_path, failures=1)
    reports = []
    writer = CheckpointWriter(storage, rank=0, report=reports.append, upload_attempts=2, retry_backoff_s=0.01)
    writer.save(1, {"w": torch.ones(3)}, extra={}, owns_plain_tensors=True)
    writer.wait()
    assert storage.calls == 2 and reports[-1].kind == "shard"
    storage.failures = 5
    writer.save(2, {"w": torch.ones(3)}, extra={}, owns_plain_tensors=True)
    writer.close()
    assert reports[-1] == FailureReport(step=2, rank=0, attempts=2, error="OSError: connection reset by peer")


def test_save_sync_raises_when_the_upload_fails(tmp_path):
    storage = GatedStorage(tmp_path, failures=3)
    reports = []
    writer = CheckpointWriter(storage, rank=0, report=reports.append, upload_attempts=2, retry_backoff_s=0.0)
    with pytest.raises(Exception, match="rank 0's checkpoint upload failed: OSError"):
        writer.save_sync(4, {"w": torch.ones(3)}, extra={}, owns_plain_tensors=True)
    assert reports[-1].kind == "failure"
    writer.close()


def test_every_rank_reports_even_without_files(tmp_path):
    """Two ranks; plain tensors are written only by the owner; the step commits with both reports."""
    storage = LocalStorage(tmp_path, fsync=False)
    coordinator = coordinator_for(storage, world_size=2)
    reports = []

    def report(message):
        reports.append(message)
        coordinator.on_report(message)

    writers = [CheckpointWriter(storage, rank=rank, report=report) for rank in range(2)]
    state = {"w": torch.arange(6.0), "step": torch.tensor(3.0)}
    started = time.perf_counter()
    for rank, writer in enumerate(writers):
        writer.save(3, state, extra={"rank": rank}, owns_plain_tensors=rank == 0)
    for writer in writers:
        writer.close()
    assert time.perf_counter() - started < 30
    assert sorted((r.rank, len(r.files)) for r in reports) == [(0, 1), (1, 0)]
    manifest = load_manifest(storage)
    assert manifest.step == 3 and manifest.extra == {"rank": 0}
    assert [f.rank for f in manifest.files] == [0]


def test_a_process_moved_to_another_pipeline_stage_writes_its_own_slices(tmp_path):
    """After an in-place restore a surviving process may take another rank: here rank 4 (stage 1)
    of pp=2 x dp_shard=2 x tp=2 in one generation, rank 2 (stage 0) in the next, while the
    earlier generation's mesh still lives. The two stages' (dp_shard, tp) sub-meshes compare
    equal; rank 2 must still write its block, or every later checkpoint is torn."""
    reports = []
    earlier_meshes = []
    for rank in (4, 2):  # fake process groups: this one process is that rank of 8
        dist.init_process_group("fake", rank=rank, world_size=8, store=FakeStore())
        try:
            world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_shard", "tp"))
            stage = world["dp_shard", "tp"]
            earlier_meshes.append(stage)
            # An 8 x 8 weight sharded rows over dp_shard, columns over tp.
            weight = DTensor.from_local(torch.full((4, 4), float(rank)), stage, [Shard(0), Shard(1)], run_check=False)
            writer = CheckpointWriter(LocalStorage(tmp_path, fsync=False), rank=rank, report=reports.append, mesh=world)
            writer.save(10 + rank, {"embed_tokens.weight": weight}, owns_plain_tensors=False)
            writer.close()
        finally:
            dist.destroy_process_group()
    assert [(r.rank, [(c.offsets, c.sizes) for c in r.chunks]) for r in reports] == [
        (4, [((0, 0), (4, 4))]),  # stage 1's copy at dp_shard 0, tp 0
        (2, [((4, 0), (4, 4))]),  # stage 0, dp_shard 1, tp 0: rows 4-7, columns 0-3
    ]


def test_non_tensor_state_is_refused_with_the_fix(tmp_path):
    writer = CheckpointWriter(LocalStorage(tmp_path), rank=0, report=lambda r: None)
    with pytest.raises(Exception, match="'lr' is a float, not a tensor; put non-tensor state in extra="):
        writer.save(1, {"lr": 0.1}, extra={}, owns_plain_tensors=True)
    writer.close()


def test_extra_must_be_plain_json(tmp_path):
    writer = CheckpointWriter(LocalStorage(tmp_path), rank=0, report=lambda r: None)
    with pytest.raises(Exception, match="extra= must be plain JSON"):
        writer.save(1, {"w": torch.ones(1)}, extra={"rng": torch.ones(1)}, owns_plain_tensors=True)
    writer.close()
