"""SIGKILL mid-upload: no new checkpoint becomes visible, the previous one restores, leftovers are cleaned.

The killed process is both a rank (its writer is streaming step 20) and the driver (its commit
coordinator would have committed step 20): one SIGKILL takes out both.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from checkpointing.catalog import list_committed
from checkpointing.commit import CommitCoordinator
from checkpointing.reader import latest_committed, load_manifest, restore
from checkpointing.spec import FailureReport, ShardReport
from checkpointing.storage import open_storage
from checkpointing.writer import CheckpointWriter
from tests.ranks.spawned_ranks import rank_context

PART = 5 << 20


def small_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1000, dtype=torch.float32), "step": torch.tensor(10.0)}


def big_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1000, generator=generator),
        "step": torch.tensor(20.0),
        "big": torch.randn(40 << 20 >> 2, generator=generator),
    }  # 160 MB: seconds of upload


def rank_and_driver(uri: str, endpoint_url: str, messages) -> None:
    torch.set_num_threads(1)
    storage = open_storage(uri, endpoint_url=endpoint_url, part_size=PART, concurrency=1)
    coordinator = CommitCoordinator(storage, world_size=1, mesh={"dp_shard": 1}, config_hash="h", model={}, keep_last=3)

    def commit(report: ShardReport | FailureReport) -> None:
        coordinator.on_report(report)  # the writer wants no answer; commits show in the coordinator

    writer = CheckpointWriter(storage, rank=0, report=commit)
    writer.save_sync(10, small_state(), extra={"cursor": 10}, owns_plain_tensors=True)
    messages.put(coordinator.committed_steps)
    writer.save(20, big_state(), extra={"cursor": 20}, owns_plain_tensors=True)
    messages.put("uploading")
    time.sleep(600)  # SIGKILLed long before this ends


def test_sigkill_mid_upload_leaves_previous_checkpoint(s3_bucket):
    context = rank_context()
    messages = context.Queue()
    process = context.Process(
        target=rank_and_driver, args=(s3_bucket.uri, s3_bucket.endpoint_url, messages), daemon=True
    )
    process.start()
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    try:
        assert messages.get(timeout=120) == [10]
        assert messages.get(timeout=60) == "uploading"
        deadline = time.monotonic() + 60
        while not storage.list_pending_uploads("step-00000020/"):  # parts are flowing now
            assert time.monotonic() < deadline, "the upload of step 20 never started"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
    finally:
        if process.is_alive():
            process.kill()
    assert process.exitcode == -signal.SIGKILL

    # Nothing of step 20 is visible: no manifest, no object; only the upload's orphan parts.
    assert list_committed(storage) == [10]
    assert storage.list("step-00000020/") == []
    assert [u.key.split("/")[0] for u in storage.list_pending_uploads()] == ["step-00000020"]
    manifest = load_manifest(storage, latest_committed(storage))
    restored = {"w": torch.zeros(1000), "step": torch.tensor(0.0)}
    restore(storage, manifest, restored)
    assert all(torch.equal(restored[k], v) for k, v in small_state().items())
    assert manifest.extra == {"cursor": 10}

    # The resumed run saves step 20 again; its commit triggers retention, which aborts the
    # crashed writer's upload (older than or equal to the newest commit).
    coordinator = CommitCoordinator(storage, world_size=1, mesh={"dp_shard": 1}, config_hash="h", model={}, keep_last=3)
    writer = CheckpointWriter(storage, rank=0, report=coordinator.on_report)
    writer.save_sync(20, small_state(), extra={"cursor": 20}, owns_plain_tensors=True)
    writer.close()
    assert coordinator.committed_steps == [20]
    assert storage.list_pending_uploads() == []
    assert coordinator.last_retention.aborted_uploads == [
        u for u in coordinator.last_retention.aborted_uploads if u.startswith("step-00000020/")
    ]
    assert len(coordinator.last_retention.aborted_uploads) == 1
    storage.close()
