"""One replica, no second copy of any shard: a lost rank's state comes from its buddy's memory.

Every rank snapshots its state to host memory after each step and a rank of another node (here:
another process, or the other worker node) keeps a copy (``workers/peer_snapshots.py``). These
jobs have ``dp_replicate=1`` and, unless a test says so, no checkpoint URI at all: before peer
memory, any lost rank here ended the run.
"""

from __future__ import annotations

import pytest

from orchestrator.config import ElasticConfig
from tests.faults.harness import ON_WORKER_NODES, ONE_REPLICA, assert_completed_like, before_grow, of_kind, run_job
from tests.fixtures.worker_nodes import WorkerNodes
from tests.jobs import losses, single_rank

STEPS = 10
# tp=2 x dp_shard=2: one tensor-parallel group per worker node, so a node takes one dp_shard slice.
TWO_NODES = (
    "parallelism.dp_replicate=1",
    "parallelism.dp_shard=2",
    "parallelism.tp=2",
    "parallelism.pp=1",
    "training.seq_len=32",
)
GROW_STEPS = 40  # long enough for a new node's actors to start and join before the end


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    """Losses of uninterrupted jobs, per layout and run length."""
    cache: dict[tuple, dict[int, float]] = {}

    def of(layout: tuple[str, ...], steps: int = STEPS) -> dict[int, float]:
        key = (layout, steps)
        if key not in cache:
            result, events = run_job(tmp_path_factory.mktemp("uninterrupted"), *layout, f"training.steps={steps}")
            assert result.exit_code == 0, result.reason
            cache[key] = losses(events)
        return cache[key]

    return of


@pytest.mark.slow  # CI's tier: 60 s; make test keeps the peer-memory books (tests/unit/test_peer_memory.py)
def test_killed_rank_is_rebuilt_from_peer_memory_with_bitwise_equal_state(reference, tmp_path):
    """A warm spare takes the lost rank's place on the same mesh: after the restore every loss is
    the uninterrupted run's to the bit, which it is only if the state was restored bit for bit."""
    result, events = run_job(
        tmp_path, *ONE_REPLICA, f"training.steps={STEPS}", "elastic.spare_actors=4", faults=("kill@4:3",)
    )
    assert result.exit_code == 0, result.reason
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [3]
    [restored] = of_kind(events, "restored")
    assert restored["source"] == "peer_memory" and restored["step"] == 3  # no step lost
    assert restored["to_mesh"] == restored["from_mesh"]  # the spare took rank 3's place
    assert restored["bytes_from_peers"] > 0
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["source"] == "peer_memory"
    assert [e["step"] for e in of_kind(events, "step")] == list(range(1, STEPS + 1))
    # Exactly: same mesh, same state, same math. (A step whose report died with rank 3 lacks its
    # share of the loss.)
    partial = {e["step"] for e in of_kind(events, "step") if e.get("loss_partial")}
    expected = {step: loss for step, loss in reference(ONE_REPLICA).items() if step not in partial}
    assert {step: loss for step, loss in losses(events).items() if step not in partial} == expected
    assert max(expected) == STEPS and min(expected) <= 2
    memory = of_kind(events, "snapshot_memory")[0]  # reported at start: 2 own + 2 of the buddy's
    assert memory["max_bytes"] == max(memory["bytes_per_rank"].values()) > 0 and memory["limit_bytes"] is None


@pytest.mark.slow  # CI runs this
def test_without_a_spare_the_mesh_shrinks_dp_shard_in_place_and_no_step_is_lost_with_the_defaults(reference, tmp_path):
    """Snapshot settings left at their defaults, a rank killed late in the run: every step was
    snapshotted (each copy overlaps the next step, so the cadence has no cost to stretch the
    interval for), and the newest step is restored: nothing is redone."""
    default_cadence = f"elastic.snapshot_overhead_limit={ElasticConfig.snapshot_overhead_limit}"  # the harness fixes it
    result, events = run_job(tmp_path, *ONE_REPLICA, f"training.steps={STEPS}", default_cadence, faults=("kill@9:1",))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference(ONE_REPLICA), STEPS, rel=1e-3)
    assert of_kind(events, "snapshot_interval") == []  # every step, all along
    [restored] = before_grow(events, "restored")
    assert restored["source"] == "peer_memory" and restored["step"] == 8
    assert restored["to_mesh"]["dp_shard"] < 4
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0


@pytest.mark.slow  # the commit vote's snapshot steps; CI runs this
def test_snapshots_every_third_step_restore_the_newest_one_every_rank_took(reference, tmp_path):
    """``elastic.snapshot_interval_steps=3``: the commit vote tells every rank which steps to
    snapshot (3 and 6 here), so a rank lost in step 8 is rebuilt from step 6, on every rank."""
    result, events = run_job(
        tmp_path,
        *ONE_REPLICA,
        f"training.steps={STEPS}",
        "elastic.spare_actors=4",
        "elastic.snapshot_interval_steps=3",
        faults=("kill@8:3",),
    )
    assert result.exit_code == 0, result.reason
    [restored] = of_kind(events, "restored")
    assert restored["source"] == "peer_memory" and restored["step"] == 6
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 1  # step 7, redone
    assert_completed_like_after_restore(events, reference(ONE_REPLICA), restored["step"])


@pytest.mark.slow  # a sender dying mid-copy; CI runs this
def test_a_failure_while_a_snapshot_is_copied_restores_the_older_one(reference, tmp_path):
    """Rank 3 dies while its snapshot of step 4 is on its way to its buddy: that snapshot is not
    whole, so the one of step 3 is loaded (one step redone), never a mix of the two."""
    result, events = run_job(tmp_path, *ONE_REPLICA, f"training.steps={STEPS}", faults=("kill@4:3/snapshot",))
    assert result.exit_code == 0, result.reason
    [restored] = before_grow(events, "restored")
    assert restored["source"] == "peer_memory" and restored["step"] == 3
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 1
    assert_completed_like_after_restore(events, reference(ONE_REPLICA), restored["step"])


@pytest.mark.slow  # a compound fault (a rank lost, its buddy stuck), ~26 s on 2 cores
def test_a_stuck_buddy_serves_the_snapshots_it_holds_before_it_is_killed(reference, tmp_path):
    """Rank 1 dies in step 7 and rank 2, which holds the copy of rank 1's snapshot, never leaves
    the aborted generation (stuck, as a rank blocked where the abort cannot reach). Its actor still
    answers, so the restore reads the copies it holds before the driver kills it: the survivors
    restore step 6 from peer memory, no step lost and no storage needed (none is configured)."""
    result, events = run_job(tmp_path, *ONE_REPLICA, f"training.steps={STEPS}", faults=("kill@7:1", "hang@7:2"))
    assert result.exit_code == 0, result.reason
    [failure] = of_kind(events, "failure")
    assert failure["ranks"] == [1, 2] and "stuck" in failure["kind"]
    [restored] = before_grow(events, "restored")
    assert restored["source"] == "peer_memory" and restored["step"] == 6
    assert restored["to_mesh"]["dp_shard"] == 2 and restored["bytes_from_peers"] > 0
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["source"] == "peer_memory"
    assert_completed_like(events, reference(ONE_REPLICA), STEPS, rel=1e-3)


@pytest.mark.slow
def test_lost_node_shrinks_dp_shard_in_place_then_grows_back_from_peer_memory(reference, ray_cluster, tmp_path):
    nodes = WorkerNodes(ray_cluster, 2, ranks_per_node=2)
    added = []

    def add_a_node_once_lost(event):
        if event["event"] == "failure" and not added:
            added.append(nodes.add())

    try:
        result, events = run_job(
            tmp_path,
            *TWO_NODES,
            ON_WORKER_NODES,
            f"training.steps={GROW_STEPS}",
            faults=("node@5:2",),
            node_fault=nodes.remove,
            on_event=add_a_node_once_lost,
        )
    finally:
        nodes.close()
    assert result.exit_code == 0, result.reason
    # Against one process: the mesh changes twice, and each must train like one process (the
    # uninterrupted tp=2 x dp_shard=2 run is 1e-5 from it; it took 100 s here, one process 10 s).
    assert_completed_like(events, reference(single_rank("training.seq_len=32"), GROW_STEPS), GROW_STEPS, rel=1e-3)
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "node_lost" and failure["ranks"] == [2, 3]
    [shrunk, grown] = of_kind(events, "restored")
    assert shrunk["source"] == grown["source"] == "peer_memory"
    assert shrunk["to_mesh"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert grown["to_mesh"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["source"] == "peer_memory"
    [grow] = of_kind(events, "grow")
    assert grow["source"] == "peer_memory" and grow["added_ranks"] == [2, 3]


def assert_completed_like_after_restore(events, reference, restored_step: int) -> None:
    """Every step applied, the last application of each with the uninterrupted run's loss."""
    applied = {e["step"]: e["loss"] for e in of_kind(events, "step")}
    assert sorted(applied) == list(range(1, STEPS + 1))
    assert applied == pytest.approx(reference, rel=1e-3)
    rewound = [e["step"] for e in of_kind(events, "step") if e["step"] > restored_step]
    assert rewound[-(STEPS - restored_step) :] == list(range(restored_step + 1, STEPS + 1))


@pytest.mark.slow  # a compound fault: two recoveries, one of them aborted, ~40 s on 2 cores
def test_a_rank_lost_while_the_recovery_builds_its_groups_is_not_waited_for_the_collective_timeout(reference, tmp_path):
    """A fault during a recovery, where the abort cannot reach: ``kill@6:1`` is restored onto the
    three survivors and a warm spare (rank 3, holding no snapshot), and as that mesh builds its
    process groups the spare dies (``kill@6:3/join``). The others then wait in torch's
    rendezvous, which no abort interrupts, until the collective timeout (120 s). The snapshot of
    step 5 is whole without waiting for them (their actors linger and serve their copies): past
    the hang threshold they count as stuck and the recovery restores step 5 onto the remaining
    spares. Every step once, 0 lost, and no two-minute stall."""
    result, events = run_job(
        tmp_path,
        *ONE_REPLICA,
        f"training.steps={STEPS}",
        "elastic.spare_actors=4",
        faults=("kill@6:1", "kill@6:3/join"),
    )
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference(ONE_REPLICA), STEPS, rel=1e-3)
    first, second = of_kind(events, "failure")
    assert first["kind"] == "rank_died"
    assert "stuck" in second["kind"].split(","), second
    restored = of_kind(events, "restored")
    assert [r["source"] for r in restored] == ["peer_memory"] * len(restored) and restored[-1]["step"] == 5
    assert of_kind(events, "recovered")[-1]["lost_steps"] == 0
    # The second failure is known within the hang threshold (8 s) and a few polls, not 120 s.
    assert second["time"] - first["time"] < 60, second["time"] - first["time"]
