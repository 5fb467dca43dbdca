"""A peer-memory snapshot overlaps the next step: single process, world size 1, real gloo, no Ray.

``workers/peer_snapshots.py``: the copy of step N's state runs on the copier thread while step
N + 1's forward and backward run on the loop thread; only N + 1's optimizer step waits for it.
The copy is held at a gate until step N + 1 has computed its gradients, so the order below is
forced, not a race the test hopes to win.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from checkpointing.staging import HostBuffer
from elastic.spec import MeshSpec
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.peer_snapshots import RankSnapshots, SnapshotStore, snapshot_key
from workers.reporting import ReportChannel
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.spec.messages import SnapshotPlan, SnapshotReport
from workers.trainer import Trainer

SPEC = TrainSpec(model=PRESETS["debug"], steps=3, global_batch=2, seq_len=8, microbatch_size=1, microbatches=1)
GENERATION = 1


@pytest.fixture
def trainer():
    init_generation(store=dist.HashStore(), generation=GENERATION, rank=0, world_size=1, backend="gloo", timeout_s=30)
    par.forget_old_meshes()
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = Trainer(SPEC, MeshSpec(), 0, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    yield trainer
    trainer.close()
    dist.destroy_process_group()


def state_bytes(snapshots: RankSnapshots, state: dict[str, torch.Tensor]) -> bytes:
    """The bytes a snapshot of ``state`` holds (the snapshots' own layout)."""
    buffer = HostBuffer(snapshots._layout, pin_memory=False)
    buffer.stage(state)
    return bytes(buffer.memoryview())


def test_the_copy_of_a_step_overlaps_the_next_steps_compute_and_holds_that_step_not_the_next(trainer, monkeypatch):
    channel = ReportChannel(rank=0)
    store = SnapshotStore()
    snapshots = RankSnapshots(
        trainer, SnapshotPlan(interval_steps=1, buddy_rank=None, buddy=None), store, channel, generation=GENERATION
    )
    order: list[str] = []
    gate = threading.Event()

    staged = HostBuffer.stage

    def gated_stage(buffer, tensors, *, wait=True):  # the copier's copy to host memory
        assert gate.wait(timeout=30), "step 2 never computed its gradients"
        staged(buffer, tensors, wait=wait)
        order.append("copied step 1")

    synced = trainer.rank_device.sync

    def sync_then_open_the_gate():  # step 2's forward and backward are done here
        synced()
        order.append("computed step 2")
        gate.set()

    updated = trainer.optimizer.step

    def update(*args, **kwargs):
        order.append("optimizer step")
        return updated(*args, **kwargs)

    first = trainer.train_step(1)
    after_step_1 = {fqn: value.clone() for fqn, value in trainer.checkpoint_state().items()}
    monkeypatch.setattr(HostBuffer, "stage", gated_stage)
    monkeypatch.setattr(trainer.rank_device, "sync", sync_then_open_the_gate)
    monkeypatch.setattr(trainer.optimizer, "step", update)

    snapshots.after_step(1, due=True, step_time_s=first.step_time_s)  # returns with the copy held at the gate
    assert order == [] and not store.holds(snapshot_key(GENERATION, 1, 0))
    second = trainer.train_step(2, copies=snapshots)

    assert order == ["computed step 2", "copied step 1", "optimizer step"]
    key = snapshot_key(GENERATION, 1, 0)
    held = store.read(key, 0, snapshots._layout.size)
    assert held == state_bytes(snapshots, after_step_1)  # step 1's state, bit for bit
    assert held != state_bytes(snapshots, trainer.checkpoint_state())  # not step 2's, applied since
    held, report = [r for r in channel.drain() if isinstance(r, SnapshotReport)]
    assert (held.step, held.copied, held.cost_steps) == (1, False, 0.0)  # in this rank's memory, as it got there
    assert (report.step, report.copied) == (1, False)  # then its cost (a world of one: no buddy)
    # What the loop waited for the copy (step 2's snapshot_wait_s) is what the snapshot cost it.
    assert report.cost_steps * first.step_time_s >= second.phases["snapshot_wait_s"] >= 0
    snapshots.close(wait=True)


def test_a_snapshot_is_taken_only_when_due_and_the_next_update_waits_for_nothing_otherwise(trainer):
    channel = ReportChannel(rank=0)
    store = SnapshotStore()
    snapshots = RankSnapshots(
        trainer, SnapshotPlan(interval_steps=2, buddy_rank=None, buddy=None), store, channel, generation=GENERATION
    )
    for step, due in ((1, False), (2, True), (3, False)):
        result = trainer.train_step(step, copies=snapshots)
        snapshots.after_step(step, due=due, step_time_s=result.step_time_s)
    snapshots.close(wait=True)
    assert [r.step for r in channel.drain() if isinstance(r, SnapshotReport)] == [2, 2]  # held; its cost
    assert store.holds(snapshot_key(GENERATION, 2, 0)) and not store.holds(snapshot_key(GENERATION, 1, 0))
