"""A peer-memory snapshot on a GPU: the copies run on a side stream into pinned memory while the
next step's kernels run, and hold the snapshotted step's state, not the next one's.

    make test-gpu        # or: python -m pytest tests/gpu/test_snapshot_overlap.py

One process, world size 1, NCCL on GPU 0, no Ray (``tests/unit/test_snapshot_overlap.py`` forces
the order on CPU with a gate; here the device's own ordering, the side stream waiting for the
update and the update waiting for the copy, is what keeps the bytes right).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from checkpointing.staging import HostBuffer
from elastic.spec import MeshSpec
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.device import RankDevice
from workers.peer_snapshots import RankSnapshots, SnapshotStore, snapshot_key
from workers.reporting import ReportChannel
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.spec.messages import SnapshotPlan, SnapshotReport
from workers.trainer import Trainer

SPEC = TrainSpec(model=PRESETS["debug"], steps=3, global_batch=2, seq_len=64, microbatch_size=1, microbatches=1)


@pytest.fixture
def trainer():
    device = RankDevice(torch.device("cuda", 0))
    init_generation(
        store=dist.HashStore(), generation=1, rank=0, world_size=1, backend="nccl", timeout_s=60, device=device
    )
    par.forget_old_meshes()
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = Trainer(SPEC, MeshSpec(), 0, device=device, source=source)
    trainer.init_weights()
    yield trainer
    trainer.close()
    dist.destroy_process_group()


def test_a_snapshot_copied_on_a_side_stream_holds_its_step_and_lands_in_pinned_memory(trainer):
    channel = ReportChannel(rank=0)
    store = SnapshotStore()
    snapshots = RankSnapshots(
        trainer, SnapshotPlan(interval_steps=1, buddy_rank=None, buddy=None), store, channel, generation=1
    )
    first = trainer.train_step(1)
    after_step_1 = {fqn: value.detach().cpu().clone() for fqn, value in trainer.checkpoint_state().items()}
    snapshots.after_step(1, due=True, step_time_s=first.step_time_s)
    trainer.train_step(2, copies=snapshots)
    expected = HostBuffer(snapshots._layout, pin_memory=False)
    expected.stage(after_step_1)
    assert store.read(snapshot_key(1, 1, 0), 0, snapshots._layout.size) == bytes(expected.memoryview())
    assert all(buffer is None or buffer.pinned for buffer in snapshots._buffers)
    assert [r.step for r in channel.drain() if isinstance(r, SnapshotReport)] == [1, 1]  # held; its cost
    snapshots.close(wait=True)
