"""Peer-memory snapshots without Ray: the rank's store, the driver's book, buddies and the policies."""

from __future__ import annotations

import pytest

from checkpointing.spec import ChunkEntry, TensorEntry
from elastic.policy import (
    Fail,
    FailurePolicy,
    GroupStatus,
    Grow,
    Reshape,
    RestoreFromCheckpoint,
    ScalingPolicy,
    StateSource,
)
from elastic.snapshot_cadence import SnapshotCadence
from elastic.spec import MeshSpec
from orchestrator.driver.peer_memory import RecoveryPoint, SnapshotBook, buddy_ranks
from orchestrator.observe.events import EventLog, read_events
from workers.peer_snapshots import SnapshotMemoryError, SnapshotMissingError, SnapshotStore, _check_memory, snapshot_key
from workers.spec.messages import SnapshotLayoutReport, SnapshotReport

ONE_REPLICA = MeshSpec(dp_replicate=1, dp_shard=4, tp=1, pp=1)


# ------------------------------------------------------------------ the rank's store
def test_a_store_keeps_the_two_newest_snapshots_own_and_held_alike():
    store = SnapshotStore()
    for step in (1, 2, 3):
        store.put(snapshot_key(1, step, 0), (1, step), bytes([step]) * 8)  # own
        store.put(snapshot_key(1, step, 3), (1, step), bytes([10 + step]) * 4)  # held for rank 3
    assert not store.holds(snapshot_key(1, 1, 0)) and not store.holds(snapshot_key(1, 1, 3))
    assert store.read(snapshot_key(1, 3, 3), 1, 3) == bytes([13, 13])
    assert store.nbytes() == 2 * (8 + 4)
    # a later generation's snapshot is newer than any of an earlier one
    store.put(snapshot_key(2, 3, 1), (2, 3), b"x")
    assert store.holds(snapshot_key(1, 3, 0)) and not store.holds(snapshot_key(1, 2, 0))
    with pytest.raises(SnapshotMissingError, match="memory/g000001/step-00000002/rank-00000 is not held here"):
        store.read(snapshot_key(1, 2, 0), 0, 1)


def test_snapshots_that_do_not_fit_the_memory_limit_are_refused_with_the_fix():
    _check_memory(1 << 20, 4 << 20)  # 2 own + 2 of the buddy's: exactly the limit
    with pytest.raises(SnapshotMemoryError) as refused:
        _check_memory(2 << 20, 4 << 20)
    assert str(refused.value) == (
        "peer-memory snapshots need 8.0 MiB of host memory per rank (2 snapshots of this rank's 2.0 MiB of state "
        "and 2 of its buddy's), over elastic.snapshot_memory_limit_mb=4: raise the limit, shard the state over "
        "more ranks, or set elastic.snapshot_interval_steps=0 to turn snapshots off"
    )


# ------------------------------------------------------------------------ buddies
def test_a_buddy_lives_on_another_node_and_no_rank_keeps_more_copies_than_needed():
    assert buddy_ranks(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert buddy_ranks(["a", "b", "a", "b"]) == [1, 2, 3, 0]
    assert buddy_ranks(["a"] * 4) == [1, 2, 3, 0]  # one node: another process
    assert buddy_ranks(["a"]) == [None]
    for nodes in (["a", "a", "b", "b"], ["a", "b", "c", "a", "b", "c"]):
        buddies = buddy_ranks(nodes)
        assert all(nodes[rank] != nodes[buddy] for rank, buddy in enumerate(buddies) if buddy is not None)
        assert sorted(buddies) == list(range(len(nodes)))  # each rank keeps exactly one copy


# ----------------------------------------------------------------- the driver's book
class Slot:
    def __init__(self, rank: int, node: str = "n0") -> None:
        self.node_id = node
        self.actor = f"actor-{rank}"


def layout(generation: int, rank: int, buddy: int | None) -> SnapshotLayoutReport:
    """Rank ``rank`` holds rows [2 rank, 2 rank + 2) of an 8 x 2 float32 weight."""
    chunk = ChunkEntry("w", (2 * rank, 0), (2, 2), key="", start=64, end=80, block_rows=2, checksums=())
    return SnapshotLayoutReport(
        rank, 0.0, generation, buddy, bytes=80, tensors=(TensorEntry("w", (8, 2), "float32"),), chunks=(chunk,)
    )


def snapshot(generation: int, step: int, rank: int, copied: bool = True) -> SnapshotReport:
    return SnapshotReport(rank, 0.0, generation, step, copied=copied)


@pytest.fixture
def book(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    book = SnapshotBook(events, cadence=SnapshotCadence(1, 0.0), memory_limit_bytes=1 << 30, model={"preset": "debug"})
    slots = [Slot(rank) for rank in range(4)]
    plans = book.plans(1, ONE_REPLICA, slots)
    assert [plan.buddy_rank for plan in plans if plan is not None] == [1, 2, 3, 0]
    for rank in range(4):
        book.on_layout(layout(1, rank, (rank + 1) % 4))
    return book, slots, tmp_path


def test_the_newest_snapshot_every_rank_reported_is_recoverable_after_one_loss(book):
    book, slots, tmp_path = book
    for step in (1, 2):
        for rank in range(4):
            book.on_snapshot(snapshot(1, step, rank))
    book.on_snapshot(snapshot(1, 3, 0))  # step 3 is not whole yet
    gone = {id(slots[3])}
    assert book.recoverable(lambda slot: id(slot) in gone) == RecoveryPoint(1, 2)
    source = book.source(RecoveryPoint(1, 2), lambda slot: id(slot) in gone)
    # rank 3's object is read from its buddy (rank 0), the others from their owners first
    assert source.holders[snapshot_key(1, 2, 3)] == ("actor-0",)
    assert source.holders[snapshot_key(1, 2, 1)] == ("actor-1", "actor-2")
    assert source.manifest.step == 2 and source.manifest.world_size == 4
    assert [chunk.offsets for chunk in source.manifest.tensors["w"].chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
    [memory] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot_memory"]
    assert memory["bytes_per_rank"] == {"0": 320, "1": 320, "2": 320, "3": 320}  # 2 x (own 80 + buddy's 80)


def test_a_later_applied_step_proves_a_snapshot_whole_and_an_unconfirmed_copy_is_not_counted(book):
    book, slots, _ = book
    for rank in range(3):
        book.on_snapshot(snapshot(1, 4, rank))  # rank 3's report of step 4 died with it
    nobody_gone = lambda slot: False  # noqa: E731
    assert book.recoverable(nobody_gone) is None
    book.applied(1, 5)  # a rank applied step 5: every rank had its snapshot of 4 copied
    assert book.recoverable(nobody_gone) == RecoveryPoint(1, 4)
    # but whether rank 3's buddy holds the copy is unknown: without rank 3 it is not recoverable
    assert book.recoverable(lambda slot: slot is slots[3]) is None
    book.on_snapshot(snapshot(1, 4, 3))  # the buddy reports it holds the copy
    assert book.recoverable(lambda slot: slot is slots[3]) == RecoveryPoint(1, 4)


def publishing_book(tmp_path, *, overhead_limit: float) -> tuple[SnapshotBook, list[tuple[int, int]]]:
    """A snapshot book asked for snapshots every step, and the (generation, interval) it publishes."""
    published: list[tuple[int, int]] = []
    book = SnapshotBook(
        EventLog(tmp_path / "events.jsonl"),
        cadence=SnapshotCadence(1, overhead_limit),
        memory_limit_bytes=None,
        model={"preset": "debug"},
        publish_interval=lambda generation, interval_steps: published.append((generation, interval_steps)),
    )
    return book, published


def test_snapshots_costing_more_than_the_limit_are_taken_less_often_from_the_current_generation_on(tmp_path):
    book, published = publishing_book(tmp_path, overhead_limit=0.05)
    book.plans(1, ONE_REPLICA, [Slot(rank) for rank in range(4)])
    book.plans(2, ONE_REPLICA, [Slot(rank) for rank in range(4)])
    for rank in range(4):  # a snapshot costing a fifth of a step on its slowest rank
        book.on_snapshot(SnapshotReport(rank, 0.0, 2, 1, copied=True, cost_steps=0.05 * (rank + 1)))
    assert published == []  # judged once a later snapshot shows every report of it is in
    book.on_snapshot(SnapshotReport(0, 0.0, 2, 2, copied=True, cost_steps=0.05))
    assert published == [(2, 4)]  # to the newest generation's ranks
    assert [plan.interval_steps for plan in book.plans(3, ONE_REPLICA, [Slot(r) for r in range(4)]) if plan] == [4] * 4
    changes = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot_interval"]
    assert [(e["generation"], e["step"], e["interval_steps"]) for e in changes] == [(2, 2, 4)]


def test_snapshots_every_step_stay_while_their_copies_hide_behind_the_step_and_a_lengthening_says_why(tmp_path):
    """The cost the ranks report is what the loop waited for a snapshot (its copy overlaps the next
    step): near zero, snapshots stay at every step; a state too large to copy within a step makes
    the loop wait, and the interval event says by how much against the limit."""
    book, published = publishing_book(tmp_path, overhead_limit=0.02)
    book.plans(1, ONE_REPLICA, [Slot(rank) for rank in range(4)])
    for step in range(1, 8):  # copies hidden behind the next step's compute: 0.001 of a step waited
        for rank in range(4):
            book.on_snapshot(SnapshotReport(rank, 0.0, 1, step, copied=True, cost_steps=0.001))
    assert published == [] and book.interval_steps == 1
    for step in range(8, 16):  # copies a half step longer than the compute they overlap
        for rank in range(4):
            book.on_snapshot(SnapshotReport(rank, 0.0, 1, step, copied=True, cost_steps=0.5 if rank == 2 else 0.001))
    assert book.interval_steps == 25 and published[-1] == (1, 25)  # ceil(0.5 / 0.02)
    changes = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "snapshot_interval"]
    assert changes and changes[-1]["interval_steps"] == 25
    assert changes[-1]["cost_steps"] == 0.5 and changes[-1]["overhead_limit"] == 0.02
    assert all(change["cost_steps"] / change["interval_steps"] <= change["overhead_limit"] for change in changes)


def test_a_rank_and_its_buddy_both_gone_leave_no_recoverable_snapshot(book):
    book, slots, _ = book
    for rank in range(4):
        book.on_snapshot(snapshot(1, 1, rank))
    assert book.recoverable(lambda slot: slot in (slots[1], slots[2])) is None  # 2 holds 1's copy
    assert book.recoverable(lambda slot: slot in (slots[1], slots[3])) == RecoveryPoint(1, 1)
    book.unusable(RecoveryPoint(1, 1))  # a restore from it failed: never again
    assert book.recoverable(lambda slot: False) is None


# ---------------------------------------------------------------------- policies
def restore_decision(*, memory: int | None, checkpoint: int | None):
    status = GroupStatus(
        mesh=ONE_REPLICA, lost_ranks=frozenset({2}), memory_step=memory, checkpoint_step=checkpoint, completed_step=9
    )
    return FailurePolicy().decide(status, fits=lambda mesh: True, restore_mesh=lambda: ONE_REPLICA)


def test_with_no_replica_left_the_newest_whole_state_is_restored_peer_memory_first():
    assert restore_decision(memory=9, checkpoint=8) == RestoreFromCheckpoint(9, ONE_REPLICA, StateSource.PEER_MEMORY)
    assert restore_decision(memory=8, checkpoint=8) == RestoreFromCheckpoint(8, ONE_REPLICA, StateSource.PEER_MEMORY)
    assert restore_decision(memory=5, checkpoint=8) == RestoreFromCheckpoint(8, ONE_REPLICA, StateSource.STORAGE)
    assert restore_decision(memory=None, checkpoint=8).source == StateSource.STORAGE
    neither = restore_decision(memory=None, checkpoint=None)
    assert isinstance(neither, Fail) and "no peer-memory snapshot is whole" in neither.reason


def test_a_mesh_shrunk_in_another_degree_reshapes_back_once_warm_actors_can_fill_it():
    target = MeshSpec(dp_replicate=1, dp_shard=2, tp=2, pp=1)
    shrunk = MeshSpec(dp_replicate=1, dp_shard=1, tp=2, pp=1)
    policy = ScalingPolicy(target_replicas=1, target_mesh=target)
    assert policy.reshape_shortfall(shrunk) == 2
    assert policy.decide(shrunk, warm_actors=1, fits=lambda mesh: True, reshape=True) != Reshape(target)
    assert policy.decide(shrunk, warm_actors=2, fits=lambda mesh: True, reshape=True) == Reshape(target)
    assert not isinstance(policy.decide(shrunk, warm_actors=2, fits=lambda mesh: True), Reshape)  # snapshots off
    # fewer replica groups only: the replica grow (peer to peer from a replica) stays the way back
    replicas = ScalingPolicy(target_replicas=2, target_mesh=target.with_replicas(2))
    assert replicas.reshape_shortfall(target) == 0
    assert isinstance(replicas.decide(target, warm_actors=4, fits=lambda mesh: True, reshape=True), Grow)


def test_a_restore_onto_fewer_ranks_than_tp_x_pp_lowers_tp_or_pp():
    from orchestrator.config import load_config
    from orchestrator.driver.replicas import Replicas
    from orchestrator.driver.train_spec import train_spec
    from tests.jobs import DEMO_CONFIG

    replicas = Replicas(None, train_spec(load_config(DEMO_CONFIG, [])))  # no group: restore_target needs none
    configured = MeshSpec(dp_shard=2, tp=2, pp=2)
    assert replicas.restore_target(configured, 7) == MeshSpec(dp_shard=1, tp=2, pp=2)  # dp_shard gives way first
    smaller = replicas.restore_target(configured, 3)
    assert smaller is not None and smaller.world_size <= 3 and smaller.tp * smaller.pp < 4
    assert replicas.restore_target(configured, 1) == MeshSpec()


def test_the_report_says_which_restores_came_from_peer_memory_and_what_they_read():
    from orchestrator.analysis.timeline import format_summary, summarize

    events = [
        {"event": "start", "time": 0.0, "name": "job", "steps": 4, "mesh": {}, "world_size": 4},
        *({"event": "step", "time": t, "step": t, "loss": 1.0, "step_time_s": 0.5, "world_size": 4} for t in (1, 2)),
        {"event": "failure", "time": 2.5, "kind": "rank_died", "ranks": [3]},
        {"event": "restored", "time": 3.0, "step": 2, "source": "peer_memory", "bytes_from_peers": 3 << 20},
        {"event": "recovered", "time": 3.5, "mttr_s": 1.0, "lost_steps": 0, "cause": "restore"},
        *({"event": "step", "time": t, "step": t, "loss": 1.0, "step_time_s": 0.5, "world_size": 2} for t in (4, 5)),
        {"event": "done", "time": 6.0, "status": "finished", "steps": 4},
    ]
    summary = summarize(events)
    assert (summary.restores, summary.memory_restores, summary.memory_restore_bytes) == (0, 1, 3 << 20)
    assert "restores from checkpoint: 0; from peer memory: 1 (3.0 MiB from peers)" in format_summary(summary)


def test_the_book_forgets_snapshots_the_ranks_no_longer_keep(book):
    book, _, _ = book
    for step in range(1, 101):
        for rank in range(4):
            book.on_snapshot(snapshot(1, step, rank))
    assert book.recoverable(lambda slot: False) == RecoveryPoint(1, 100)
    assert sorted(book._generations[1].reported) == [98, 99, 100]  # not a growing record of the run
