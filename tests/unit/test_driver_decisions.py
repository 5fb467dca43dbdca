"""The driver's decisions that the real-job tests (tests/faults, tests/integration) make, on the fake group.

    python -m pytest tests/unit/test_driver_decisions.py -q

Each test scripts what the ranks do (tests/unit/fake_group.py) the way one real-job test's faults
make them do it, and asserts what the driver decides, as a user sees it: the events in
events.jsonl (failure kind and ranks, recovered lost_steps and meshes and source, restored
source and step, drain, grow, done status), and what the worker group was told (which actors
configure which mesh with which starts, which were killed, aborted, paused). What only the ranks
can show (losses equal to an uninterrupted run's, state equal bit for bit, bytes read from peers,
every sample once) stays with the real jobs; DECISIONS_MAP.md (worktree root) says which is which.
"""

from __future__ import annotations

from typing import Any

import pytest

from elastic.spec import MeshSpec
from orchestrator.driver.calls import CallFailed, CallFailedKind
from orchestrator.driver.chaos import chaos_kinds, chaos_schedule
from orchestrator.driver.states import Running
from orchestrator.errors import ConfigError
from tests.unit.fake_group import (
    DIED,
    ELASTIC,
    ONE_REPLICA,
    FakeGroup,
    eval_report,
    events_of,
    fake_group,
    finish,
    replicas_on,
    starts_of,
)
from workers.spec.messages import DrainNoticeReport, FailureKind, NoticeScope, RunOutcome, RunStatus

# tests/faults/harness.py's ELASTIC_LAYOUT as the driver sees it.
ELASTIC_LAYOUT = (*ELASTIC, "elastic.hang_timeout_s=8", "elastic.heartbeat_timeout_s=10")
SINGLE_REPLICA = ("parallelism.dp_replicate=1", "parallelism.dp_shard=2", "parallelism.tp=1", "parallelism.pp=1")
MESH_DP1 = {"dp_replicate": 1, "pp": 1, "dp_shard": 2, "cp": 1, "tp": 1}


def only(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The one event of a list (fails naming them when there are more or none)."""
    assert len(events) == 1, events
    return events[0]


def steps(tmp_path) -> list[int]:
    return [event["step"] for event in events_of(tmp_path, "step")]


def assert_finished(final, tmp_path, last_step: int) -> None:
    assert final.status == "finished", final.reason
    done = events_of(tmp_path)[-1]
    assert done["event"] == "done" and done["status"] == "finished" and done["steps"] == last_step


# ------------------------------------------------------------ tests/faults/test_in_place_recovery.py
LOST_RANK = {
    "sigkill": ({3: DIED}, {}, "rank_died", 3),
    "raise": (
        {1: RunOutcome(RunStatus.FAILED, 3, error="InjectedFault: raise@4:1", failure_kind=FailureKind.INJECTED)},
        {},
        "rank_error",
        1,
    ),
    # rank 2 busy in step 4 while the others wait on it in a collective
    "hang": ({}, {0: True, 1: True, 2: False, 3: True}, "hang", 2),
}


@pytest.mark.parametrize("fault", list(LOST_RANK))
def test_a_lost_rank_shrinks_in_place_keeping_the_other_replica(fault, make_controller, tmp_path):
    outcomes, waiting, kind, rank = LOST_RANK[fault]
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=10",
        script={"runs": {1: {"steps_done": 3, "held": "all", "outcomes": outcomes, "waiting": waiting}}},
    )
    final = finish(controller)
    assert_finished(final, tmp_path, 10)
    assert steps(tmp_path) == list(range(1, 11))
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == (kind, [rank])
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["lost_steps"] == 0 and recovered["cause"] == "failure" and recovered["source"] == "replica"
    assert recovered["old_mesh"]["dp_replicate"] == 2 and recovered["new_mesh"] == MESH_DP1
    if fault != "hang":  # a hang costs elastic.hang_timeout_s by definition; the others no driver timeout
        assert recovered["mttr_s"] < 5
    group = fake_group(controller)
    assert group.aborted == [(1, 4)]  # step 4 vetoed everywhere: no survivor applies it
    assert group.killed == ([2] if fault == "hang" else [])  # a hung process may hold the step: killed
    survivors = [0, 1] if rank >= 2 else [2, 3]  # the replica group that lost a rank leaves whole
    assert group.configured[1]["slots"] == survivors
    assert starts_of(group.configured[1]) == [("kept", None)] * 2 and not group.configured[1]["sync"]


def test_a_hang_is_found_only_after_the_hang_threshold(make_controller, event_times):
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=10",
        script={"runs": {1: {"steps_done": 3, "held": "all", "waiting": {0: True, 1: True, 2: False, 3: True}}}},
    )
    finish(controller)
    [started] = event_times.of("start")
    [failure] = event_times.of("failure")
    assert 8.0 < failure - started < 8.0 + 5  # elastic.hang_timeout_s=8, plus a few polls


def test_warm_spares_refill_the_lost_replica_from_a_surviving_one(make_controller, tmp_path):
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=10",
        "elastic.spare_actors=2",
        script={"runs": {1: {"steps_done": 3, "held": "all", "outcomes": {2: DIED}}}},
    )
    final = finish(controller)
    assert_finished(final, tmp_path, 10)
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["new_mesh"]["dp_replicate"] == 2 and recovered["refilled_ranks"] == [2, 3]
    refill = fake_group(controller).configured[1]
    assert starts_of(refill) == [("kept", None), ("kept", None), ("peer", 3), ("peer", 3)] and refill["sync"]
    assert refill["slots"][:2] == [0, 1]
    assert events_of(tmp_path)[-1]["replicas_consistent"] is True  # every rank's digest equal


def test_replica_groups_that_end_with_different_state_are_reported(make_controller, tmp_path):
    controller = make_controller(*ELASTIC_LAYOUT, script={"digests": {3: "other"}})
    final = finish(controller)
    assert final.status == "finished" and events_of(tmp_path)[-1]["replicas_consistent"] is False


def test_sigterm_to_one_rank_on_a_single_node_leaves_only_its_replica_group(make_controller, fake_cluster, tmp_path):
    fake_cluster.hosts = {"the-only-node"}
    notice = DrainNoticeReport(rank=1, time=0.0, reason="SIGTERM", scope=NoticeScope.PROCESS)
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=10",
        script={
            "nodes": ["the-only-node"] * 4,
            "runs": {1: {"steps_done": 4, "held": "all", "reports": {1: [notice]}}},
        },
    )
    final = finish(controller)
    assert_finished(final, tmp_path, 10)
    assert steps(tmp_path) == list(range(1, 11))
    assert not events_of(tmp_path, "failure") and not events_of(tmp_path, "restored")
    drain = only(events_of(tmp_path, "drain"))
    assert drain["ranks"] == [1] and drain["reason"] == "process told to end"
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["cause"] == "drain" and recovered["lost_steps"] == 0 and recovered["new_mesh"] == MESH_DP1
    group = fake_group(controller)
    assert group.pauses == [(1, False)]  # a pause at the step boundary, not an abort; the other replica saves nothing
    assert group.aborted == [] and not group.avoid_nodes  # the node is not drained
    assert group.configured[1]["slots"] == [2, 3] and 1 in group.removed  # the signalled actor is retired


def test_a_joining_rank_killed_while_the_refill_configures_restarts_the_recovery(make_controller, tmp_path):
    echo = CallFailed(CallFailedKind.ERROR, "PeerFailedWhileConfiguring", failure_kind=FailureKind.PEER_FAILURE)
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=10",
        "elastic.spare_actors=2",
        faults=("kill@4:2", "kill@4:2/configure"),
        script={
            "runs": {1: {"steps_done": 3, "held": "all", "outcomes": {2: DIED}}},
            "configure_failures": {2: {2: DIED, 0: echo, 1: echo, 3: echo}},
        },
    )
    final = finish(controller)
    assert_finished(final, tmp_path, 10)
    assert steps(tmp_path) == list(range(1, 11))
    assert [(e["kind"], e["ranks"]) for e in events_of(tmp_path, "failure")] == [("rank_died", [2]), ("rank_died", [2])]
    assert not events_of(tmp_path, "restored")
    assert [e["lost_steps"] for e in events_of(tmp_path, "recovered")] == [0]
    configured = fake_group(controller).configured
    # the step fault is spent by its failure; the configure fault rides the recovery's configure, then is spent too
    assert [c["faults"] for c in configured] == [["kill@4:2", "kill@4:2/configure"], ["kill@4:2/configure"], []]
    assert [c["mesh"].dp_replicate for c in configured] == [2, 2, 2]
    assert configured[2]["slots"][:2] == [0, 1] and starts_of(configured[2])[:2] == [("kept", None)] * 2
    assert controller.failure_policy.attempts == 2 and len(controller.failure_policy.failure_times) == 1


MOE_LAYOUTS = {
    "ep2": (("parallelism.ep=2",), 3, "dp_shard"),
    "tp2": (("parallelism.dp_shard=1", "parallelism.tp=2"), 2, "tp"),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_a_killed_rank_of_a_moe_replica_group_shrinks_in_place(layout, make_controller, tmp_path):
    overrides, killed, kept_dim = MOE_LAYOUTS[layout]
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "model.preset=debug-moe",
        *overrides,
        "training.steps=10",
        script={"runs": {1: {"steps_done": 3, "held": "all", "outcomes": {killed: DIED}}}},
    )
    assert_finished(finish(controller), tmp_path, 10)
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == ("rank_died", [killed])
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["lost_steps"] == 0
    assert (recovered["new_mesh"]["dp_replicate"], recovered["new_mesh"][kept_dim]) == (1, 2)


# ------------------------------------------------------------------------ tests/faults/test_nodes.py
TWO_NODES = replicas_on("n0", "n1", size=2)


@pytest.mark.parametrize("cause", ["node", "kill"])
def test_a_shrunk_job_grows_back_once_replacement_actors_are_warm(cause, make_controller, fake_cluster, tmp_path):
    """test_nodes: node@5:2 removes replica 1's node; test_token_data: kill@4:3. Either way the job
    shrinks in place, the driver starts a replica group's worth of actors where there is room, and
    once they are warm the mesh grows back at a step boundary, the joiners copying replica 0's state."""
    fake_cluster.hosts = {"n0", "n1"}
    fake_cluster.capacity = ["n2"]
    first = (
        {"steps_done": 5, "held": "all"} if cause == "node" else {"steps_done": 3, "held": "all", "outcomes": {3: DIED}}
    )
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=20",
        faults=("node@5:2",) if cause == "node" else (),
        script={"nodes": TWO_NODES, "runs": {1: first, 2: {"steps_done": 8, "held": "all"}}},
    )
    final = finish(controller)
    assert_finished(final, tmp_path, 20)
    assert steps(tmp_path) == list(range(1, 21))
    failure = only(events_of(tmp_path, "failure"))
    if cause == "node":
        assert (failure["kind"], failure["ranks"], failure["node"]) == ("node_lost", [2, 3], "n1")
    else:
        assert (failure["kind"], failure["ranks"]) == ("rank_died", [3])
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1
    grow = only(events_of(tmp_path, "grow"))
    assert grow["new_mesh"] == recovered["old_mesh"] and grow["added_ranks"] == [2, 3] and grow["source"] == "replica"
    group = fake_group(controller)
    assert group.pauses == [(2, False)]
    grown = group.configured[2]
    assert starts_of(grown) == [("kept", None), ("kept", None), ("peer", 8), ("peer", 8)] and grown["sync"]
    assert events_of(tmp_path)[-1]["replicas_consistent"] is True


DRAINS = {
    # Ray marks the node draining: its every rank leaves
    "ray-drain": ({"draining": {"n1"}}, [2, 3], "node draining"),
    # SIGTERM to one process: its replica group leaves, the node and its other actor stay
    "sigterm": (
        {"reports": {2: [DrainNoticeReport(rank=2, time=0.0, reason="SIGTERM", scope=NoticeScope.PROCESS)]}},
        [2],
        "process told to end",
    ),
    # a cloud instance-action notice a rank read: its node goes away
    "cloud-notice": (
        {"reports": {2: [DrainNoticeReport(rank=2, time=0.0, reason="instance action: terminate")]}},
        [2, 3],
        "node draining",
    ),
}


@pytest.mark.parametrize("notice", list(DRAINS))
def test_a_drain_notice_leaves_at_a_step_boundary_with_zero_lost_steps(notice, make_controller, fake_cluster, tmp_path):
    plan, ranks, reason = DRAINS[notice]
    fake_cluster.hosts = {"n0", "n1"}
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=12",
        script={"nodes": TWO_NODES, "runs": {1: {"steps_done": 5, "held": "all", **plan}}},
    )
    final = finish(controller)
    assert_finished(final, tmp_path, 12)
    assert steps(tmp_path) == list(range(1, 13))
    assert not events_of(tmp_path, "failure")
    drain = only(events_of(tmp_path, "drain"))
    assert (drain["node"], drain["ranks"], drain["reason"]) == ("n1", ranks, reason)
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["cause"] == "drain" and recovered["lost_steps"] == 0 and recovered["new_mesh"] == MESH_DP1
    group = fake_group(controller)
    assert group.pauses == [(1, False)] and group.aborted == []
    assert group.configured[1]["slots"] == [0, 1] and starts_of(group.configured[1]) == [("kept", None)] * 2
    assert group.avoid_nodes == ({"n1"} if notice == "cloud-notice" else set())  # never placed on again


# ------------------------------------------------------------------ tests/faults/test_peer_memory.py
def peer_memory_job(make_controller, *overrides: str, runs: dict[int, dict[str, Any]], **make: Any):
    """One replica of four ranks taking a snapshot every step, no checkpoint URI unless ``make`` says."""
    return make_controller(
        *ONE_REPLICA,
        "elastic.hang_timeout_s=8",
        "training.steps=10",
        *overrides,
        script={"snapshots": True, "runs": runs},
        **make,
    )


def test_a_killed_rank_is_rebuilt_from_peer_memory_onto_a_warm_spare(make_controller, tmp_path):
    controller = peer_memory_job(
        make_controller, "elastic.spare_actors=4", runs={1: {"steps_done": 3, "held": "all", "outcomes": {3: DIED}}}
    )
    assert_finished(finish(controller), tmp_path, 10)
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == ("rank_died", [3])
    restored = only(events_of(tmp_path, "restored"))
    assert restored["source"] == "peer_memory" and restored["step"] == 3 and restored["uri"] == "peer-memory"
    assert restored["to_mesh"] == restored["from_mesh"]  # the spare took rank 3's place
    assert restored["bytes_from_peers"] > 0  # the driver adds up what the ranks say they read
    recovered = only(events_of(tmp_path, "recovered"))
    assert (recovered["lost_steps"], recovered["source"], recovered["cause"]) == (0, "peer_memory", "restore")
    assert steps(tmp_path) == list(range(1, 11))
    restore = fake_group(controller).configured[1]
    assert starts_of(restore) == [("memory", 3)] * 4
    assert restore["slots"] == [0, 1, 2, 4]  # the three survivors, then the first spare
    memory = events_of(tmp_path, "snapshot_memory")[0]  # at start: 2 own + 2 of the buddy's
    assert memory["max_bytes"] == max(memory["bytes_per_rank"].values()) > 0 and memory["limit_bytes"] is None


def test_without_a_spare_the_survivors_restore_peer_memory_onto_fewer_ranks(make_controller, tmp_path):
    controller = peer_memory_job(make_controller, runs={1: {"steps_done": 5, "held": "all", "outcomes": {1: DIED}}})
    assert_finished(finish(controller), tmp_path, 10)
    restored = only(events_of(tmp_path, "restored"))
    assert restored["source"] == "peer_memory" and restored["step"] == 5 and restored["to_mesh"]["dp_shard"] < 4
    assert only(events_of(tmp_path, "recovered"))["lost_steps"] == 0
    assert steps(tmp_path) == list(range(1, 11))
    assert fake_group(controller).configured[1]["slots"] == [0, 2, 3][: restored["to_mesh"]["dp_shard"]]


def test_snapshots_every_third_step_restore_the_newest_one_every_rank_took(make_controller, tmp_path):
    controller = peer_memory_job(
        make_controller,
        "elastic.spare_actors=4",
        "elastic.snapshot_interval_steps=3",
        runs={1: {"steps_done": 7, "held": "all", "outcomes": {3: DIED}}},
    )
    assert_finished(finish(controller), tmp_path, 10)
    restored = only(events_of(tmp_path, "restored"))
    assert restored["source"] == "peer_memory" and restored["step"] == 6
    assert only(events_of(tmp_path, "recovered"))["lost_steps"] == 1  # step 7, redone
    assert steps(tmp_path) == [*range(1, 8), *range(7, 11)]


def test_a_failure_while_a_snapshot_is_copied_restores_the_older_one(make_controller, tmp_path):
    """kill@4:3/snapshot: rank 3 dies while its snapshot of step 4 goes to its buddy; only step 3 is whole."""
    controller = peer_memory_job(
        make_controller, runs={1: {"steps_done": 4, "held": "all", "outcomes": {3: DIED}, "uncopied": {(4, 3)}}}
    )
    assert_finished(finish(controller), tmp_path, 10)
    restored = only(events_of(tmp_path, "restored"))
    assert restored["source"] == "peer_memory" and restored["step"] == 3
    assert only(events_of(tmp_path, "recovered"))["lost_steps"] == 1
    assert steps(tmp_path) == [*range(1, 5), *range(4, 11)]


def test_a_rank_and_its_buddy_both_lost_fall_back_to_storage(make_controller, fake_cluster, tmp_path):
    fake_cluster.capacity = [None]  # room for the replacement actors the storage restore waits for
    controller = peer_memory_job(
        make_controller,
        committed_steps=[],
        # rank 2 holds rank 1's copy
        runs={1: {"steps_done": 6, "held": "all", "outcomes": {1: DIED, 2: DIED}, "commits": [2, 4, 6]}},
    )
    FakeGroup.script["saves_to"] = controller.checkpoints
    assert_finished(finish(controller), tmp_path, 10)
    failure = only(events_of(tmp_path, "failure"))
    assert failure["ranks"] == [1, 2]
    restored = only(events_of(tmp_path, "restored"))
    assert restored["source"] == "storage" and restored["step"] == 6 and restored["uri"] == "file:///fake"
    assert starts_of(fake_group(controller).configured[1]) == [("checkpoint", 6)] * 4
    assert steps(tmp_path) == list(range(1, 11))


def test_a_stuck_buddy_serves_the_snapshots_it_holds_before_it_is_killed(make_controller, tmp_path):
    """Rank 1 dies in step 7; rank 2, which holds the copy of its snapshot, never leaves the aborted
    generation. Past the hang threshold it is stuck: its actor lingers (not killed, not warm) until
    the restore onto the other two has read its copies, then it is removed."""
    controller = peer_memory_job(
        make_controller, runs={1: {"steps_done": 6, "held": "all", "outcomes": {1: DIED}, "stuck": {2}}}
    )
    assert_finished(finish(controller), tmp_path, 10)
    failure = only(events_of(tmp_path, "failure"))
    assert failure["ranks"] == [1, 2] and failure["kind"] == "rank_died,stuck"
    restored = only(events_of(tmp_path, "restored"))
    assert restored["source"] == "peer_memory" and restored["step"] == 6 and restored["to_mesh"]["dp_shard"] == 2
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["lost_steps"] == 0 and recovered["source"] == "peer_memory"
    group = fake_group(controller)
    assert group.configured[1]["slots"] == [0, 3] and 2 not in group.killed
    assert group.removed[-1] == 2  # removed once the restore configured, not before
    assert steps(tmp_path) == list(range(1, 11))


def test_a_lost_node_shrinks_dp_shard_from_peer_memory_then_reshapes_back(make_controller, fake_cluster, tmp_path):
    """tp=2 x dp_shard=2, one tensor-parallel pair per node: node@5:2 takes one dp_shard slice. The
    survivors restore the snapshot onto tp=2 alone; once a new node's actors are warm the job
    reshapes back at a step boundary, every rank loading that boundary's snapshot."""
    fake_cluster.hosts = {"n0", "n1"}
    fake_cluster.capacity = ["n2"]
    controller = make_controller(
        "parallelism.dp_replicate=1",
        "parallelism.dp_shard=2",
        "parallelism.tp=2",
        "parallelism.pp=1",
        "training.steps=20",
        faults=("node@5:2",),
        script={
            "snapshots": True,
            "nodes": ["n0", "n0", "n1", "n1"],
            "runs": {1: {"steps_done": 5, "held": "all"}, 2: {"steps_done": 9, "held": "all"}},
        },
    )
    assert_finished(finish(controller), tmp_path, 20)
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == ("node_lost", [2, 3])
    shrunk, grown = events_of(tmp_path, "restored")
    assert shrunk["source"] == grown["source"] == "peer_memory" and (shrunk["step"], grown["step"]) == (5, 9)
    assert shrunk["to_mesh"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 1, "cp": 1, "tp": 2}
    assert grown["to_mesh"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["lost_steps"] == 0 and recovered["source"] == "peer_memory"
    grow = only(events_of(tmp_path, "grow"))
    assert grow["source"] == "peer_memory" and grow["added_ranks"] == [2, 3]
    group = fake_group(controller)
    assert group.pauses == [(2, False)] and starts_of(group.configured[2]) == [("memory", 9)] * 4
    assert steps(tmp_path) == list(range(1, 21))


def test_a_rank_lost_while_the_restore_builds_its_groups_is_not_waited_for_the_collective_timeout(
    make_controller, tmp_path, event_times
):
    """kill@6:1, then kill@6:3/join: the spare that took rank 3 dies as the restored mesh builds its
    process groups, and the others sit in torch's rendezvous (no configure answer, out of the
    abort's reach) until the collective timeout, 120 s. The snapshot of step 5 is whole without
    them: past the hang threshold they count as stuck, linger to serve their copies, and the
    restore goes on onto the remaining spares."""
    controller = peer_memory_job(
        make_controller, "elastic.spare_actors=4", runs={1: {"steps_done": 5, "held": "all", "outcomes": {1: DIED}}}
    )
    FakeGroup.script |= {"configure_failures": {2: {3: DIED}}, "configure_held": {2: {0, 1, 2}}}
    assert_finished(finish(controller), tmp_path, 10)
    first, second = events_of(tmp_path, "failure")
    assert first["kind"] == "rank_died" and second["ranks"] == [0, 1, 2, 3]
    assert second["kind"] == "rank_died,stuck"
    restored = events_of(tmp_path, "restored")
    assert [r["source"] for r in restored] == ["peer_memory"] and restored[-1]["step"] == 5
    assert events_of(tmp_path, "recovered")[-1]["lost_steps"] == 0
    assert steps(tmp_path) == list(range(1, 11))
    first_at, second_at = event_times.of("failure")
    assert second_at - first_at < 8.0 + 10  # the hang threshold and a few polls, not the collective timeout
    configured = fake_group(controller).configured
    assert starts_of(configured[2]) == [("memory", 5)] * len(configured[2]["starts"])
    assert set(configured[2]["slots"]).isdisjoint(configured[1]["slots"])  # onto the remaining spares


# -------------------------------------------------------------- tests/faults/test_checkpoint_faults.py
def checkpointed_job(make_controller, *overrides: str, runs: dict[int, dict[str, Any]], **make: Any):
    """One replica of two ranks saving to (fake) storage, no peer-memory snapshots; ``runs[n]["commits"]``
    are the checkpoints that commit as run n goes."""
    controller = make_controller(
        *SINGLE_REPLICA,
        "training.steps=14",
        "elastic.snapshot_interval_steps=0",
        *overrides,
        committed_steps=make.pop("committed_steps", []),
        script={"runs": runs},
        **make,
    )
    FakeGroup.script["saves_to"] = controller.checkpoints
    return controller


def test_no_surviving_replica_without_snapshots_restores_the_latest_checkpoint(make_controller, fake_cluster, tmp_path):
    fake_cluster.capacity = [None]  # a replica group's worth of new actors can start
    controller = checkpointed_job(
        make_controller, runs={1: {"steps_done": 11, "held": "all", "outcomes": {1: DIED}, "commits": [2, 4, 6, 8, 10]}}
    )
    assert_finished(finish(controller), tmp_path, 14)
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == ("rank_died", [1])
    restored = only(events_of(tmp_path, "restored"))
    assert (restored["step"], restored["source"], restored["uri"]) == (10, "storage", "file:///fake")
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["cause"] == "restore" and recovered["lost_steps"] == 1 and recovered["source"] == "storage"
    assert steps(tmp_path) == [*range(1, 12), *range(11, 15)]  # step 11 redone from checkpoint 10
    restore = fake_group(controller).configured[1]
    # the survivor and one newly started actor, not a restore onto the one rank at hand
    assert starts_of(restore) == [("checkpoint", 10)] * 2 and restore["slots"] == [0, 2]


def test_the_only_rank_killed_fires_its_fault_once(make_controller, fake_cluster, tmp_path):
    """A failure spends the fault of the step it interrupted: the redo of step 10 is not killed again."""
    fake_cluster.capacity = [None]
    controller = checkpointed_job(
        make_controller,
        "parallelism.dp_shard=1",
        faults=("kill@10:0",),
        runs={1: {"steps_done": 9, "held": "all", "outcomes": {0: DIED}, "commits": [3, 6, 9]}},
    )
    assert_finished(finish(controller), tmp_path, 14)
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == ("rank_died", [0])
    assert max(step for step in steps(tmp_path)[:9]) == 9 and only(events_of(tmp_path, "restored"))["step"] == 9
    assert [configured["faults"] for configured in fake_group(controller).configured] == [["kill@10:0"], []]


@pytest.mark.parametrize("written_by", ["same mesh", "another mesh"])
def test_a_rerun_resumes_from_the_newest_committed_checkpoint(written_by, make_controller, tmp_path):
    """test_driver_killed_and_restarted (and test_submit's resume, and test_token_data's resume onto
    another data-parallel degree): a run that finds committed checkpoints starts every rank from
    the newest, resharded from the mesh that wrote it, and trains only the steps after it."""
    other = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)
    controller = make_controller(
        *SINGLE_REPLICA,
        "training.steps=14",
        committed_steps=[2, 4, 6],
        written_by=other if written_by == "another mesh" else None,
    )
    assert_finished(finish(controller), tmp_path, 14)
    restored = only(events_of(tmp_path, "restored"))
    assert restored["step"] == 6 and restored["source"] == "storage"
    assert restored["from_mesh"] == (other if written_by == "another mesh" else controller.config.mesh).as_dict()
    assert restored["to_mesh"]["dp_shard"] == 2 and restored["to_mesh"]["dp_replicate"] == 1
    assert starts_of(fake_group(controller).configured[0]) == [("checkpoint", 6)] * 2
    assert steps(tmp_path) == list(range(7, 15))
    assert not events_of(tmp_path, "failure") and not events_of(tmp_path, "recovered")


def test_checkpoint_resume_false_starts_fresh_although_checkpoints_exist(make_controller, tmp_path):
    controller = make_controller("checkpoint.resume=false", committed_steps=[2])
    assert_finished(finish(controller), tmp_path, 4)
    assert starts_of(fake_group(controller).configured[0]) == [("fresh", None)] * 2
    assert not events_of(tmp_path, "restored") and steps(tmp_path) == [1, 2, 3, 4]


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one_with_a_warning(make_controller, tmp_path, caplog):
    """The rank that finds a checksum mismatch says which step; the driver warns, never chooses that
    step again, and restores the previous commit (its file names come from the rank's error)."""
    controller = make_controller(*SINGLE_REPLICA, "training.steps=14", committed_steps=[2, 4], script={"corrupt": {4}})
    assert_finished(finish(controller), tmp_path, 14)
    assert [starts_of(c) for c in fake_group(controller).configured] == [
        [("checkpoint", 4)] * 2,
        [("checkpoint", 2)] * 2,
    ]
    assert only(events_of(tmp_path, "restored"))["step"] == 2 and steps(tmp_path) == list(range(3, 15))
    assert "checkpoint step 4 is corrupt (CorruptCheckpointError: step 4: checksum mismatch)" in caplog.text


def run_until_step(controller, step: int) -> None:
    """Step the controller until the run has emitted ``step`` (it is running)."""
    for _ in range(100):
        controller.step()
        if controller.router.last_emitted_step >= step:
            assert isinstance(controller.state, Running)
            return
    raise AssertionError(f"no step {step}")


def test_sigterm_on_the_driver_saves_at_the_step_boundary_then_stops(make_controller, tmp_path):
    controller = checkpointed_job(make_controller, runs={1: {"steps_done": 4, "held": "all"}})
    run_until_step(controller, 4)
    controller.request_termination()
    final = finish(controller)
    assert (final.status, final.exit_code) == ("preempted", 143)
    assert final.reason == "terminated; checkpoint step 4 is the place to resume from"
    group = fake_group(controller)
    assert group.pauses == [(1, True)] and group.stops == 0  # a pause that saves, not a stop
    done = events_of(tmp_path)[-1]
    assert (done["status"], done["steps"]) == ("preempted", 4)
    assert controller.checkpoints.latest_step() == 4  # the emergency checkpoint: nothing to redo


def test_sigterm_on_the_driver_without_checkpoints_stops_like_ctrl_c(make_controller, tmp_path):
    controller = make_controller(*SINGLE_REPLICA, script={"runs": {1: {"steps_done": 2, "held": "all"}}})
    run_until_step(controller, 2)
    controller.request_termination()
    final = finish(controller)
    assert (final.status, final.exit_code) == ("interrupted", 130)
    assert fake_group(controller).pauses == [] and fake_group(controller).stops == 1


def test_ctrl_c_stops_every_rank_after_the_step_in_flight_and_exits_130(make_controller, tmp_path):
    controller = make_controller(
        *SINGLE_REPLICA, "training.steps=1000", script={"runs": {1: {"steps_done": 3, "held": "all"}}}
    )
    run_until_step(controller, 3)
    controller.request_interrupt()
    final = finish(controller)
    assert (final.status, final.exit_code, final.reason) == ("interrupted", 130, "interrupted by the user")
    group = fake_group(controller)
    assert group.stops == 1 and group.shut_down
    done = events_of(tmp_path)[-1]
    assert done["event"] == "done" and done["status"] == "interrupted" and done["steps"] == 3


def test_a_second_ctrl_c_stops_at_once(make_controller):
    controller = make_controller(*SINGLE_REPLICA)
    controller.request_interrupt()
    with pytest.raises(KeyboardInterrupt):  # raised in the signal handler, caught by run()
        controller.request_interrupt()


def test_draining_the_only_replica_saves_first_and_restores_elsewhere(make_controller, fake_cluster, tmp_path):
    """drain@5:0: the node of the only replica group drains. Its ranks pause at the step boundary
    and save first; the checkpoint of that step is restored onto actors started on another node:
    no failure, no step lost or repeated."""
    fake_cluster.hosts = {"n1", "n2"}
    fake_cluster.capacity = ["n2"]
    controller = make_controller(
        *SINGLE_REPLICA,
        "training.steps=14",
        committed_steps=[],
        script={"nodes": ["n1", "n1"], "runs": {1: {"steps_done": 5, "held": "all", "draining": {"n1"}}}},
    )
    FakeGroup.script["saves_to"] = controller.checkpoints
    assert_finished(finish(controller), tmp_path, 14)
    assert not events_of(tmp_path, "failure")
    drain = only(events_of(tmp_path, "drain"))
    assert (drain["node"], drain["ranks"]) == ("n1", [0, 1])
    assert fake_group(controller).pauses == [(1, True)]  # every replica leaves: save at the boundary first
    restored = only(events_of(tmp_path, "restored"))
    assert restored["step"] == 5 and restored["source"] == "storage"
    assert only(events_of(tmp_path, "recovered"))["lost_steps"] == 0
    assert steps(tmp_path) == list(range(1, 15))  # each step exactly once
    assert {slot.node_id for slot in fake_group(controller).active} == {"n2"}


def test_draining_every_node_that_can_hold_a_rank_stops_with_the_place_to_resume_from(
    make_controller, fake_cluster, tmp_path
):
    fake_cluster.hosts = {"n1"}
    controller = make_controller(
        *SINGLE_REPLICA,
        "training.steps=14",
        committed_steps=[],
        script={"nodes": ["n1", "n1"], "runs": {1: {"steps_done": 5, "held": "all", "draining": {"n1"}}}},
    )
    FakeGroup.script["saves_to"] = controller.checkpoints
    final = finish(controller)
    assert (final.status, final.exit_code) == ("preempted", 143)
    assert final.reason == (
        "every node that can hold a rank is draining (n1); checkpoint step 5 is the place to resume from"
    )


def test_a_save_in_flight_when_a_replicas_node_is_lost_commits_and_is_restored_after_a_second_fault(
    make_controller, fake_cluster, tmp_path
):
    """node@3:2 then kill@4:0/configure: replica 1's node goes right after step 3 was saved; the
    driver tells the commit book that the old mesh's saves up to step 3 complete without ranks 2
    and 3 (replica 0 survived whole and writes every slice). Rank 0 then dies while the shrunk mesh
    configures: no replica is whole, and the run restores step 3 from storage."""
    fake_cluster.hosts = {"n0", "n1"}
    fake_cluster.capacity = ["n2"]
    controller = checkpointed_job(
        make_controller,
        *ELASTIC_LAYOUT,
        faults=("node@3:2", "kill@4:0/configure"),
        runs={1: {"steps_done": 3, "held": "all", "commits": [3]}},  # the save the reset completes
    )
    FakeGroup.script |= {"nodes": TWO_NODES, "configure_failures": {2: {0: DIED}}}
    assert_finished(finish(controller), tmp_path, 14)
    assert controller.checkpoints.resets[1] == (2, 3, frozenset({2, 3}))
    node_lost, second = events_of(tmp_path, "failure")
    assert (node_lost["kind"], node_lost["ranks"]) == ("node_lost", [2, 3])
    assert (second["kind"], second["ranks"]) == ("rank_died", [0])
    restored = only(events_of(tmp_path, "restored"))
    assert restored["step"] == 3 and restored["source"] == "storage"
    assert fake_group(controller).configured[1]["faults"] == ["kill@4:0/configure"]
    assert steps(tmp_path) == list(range(1, 15))


def test_a_lost_node_with_a_stuck_survivor_restores_from_peer_memory_and_grows_back_in_two_steps(
    make_controller, fake_cluster, tmp_path
):
    """test_nodes' other branch (a loaded machine): node@5:2, and rank 1 of the surviving replica
    never leaves the aborted generation. Both replica groups are hit: the stuck rank's actor
    lingers and serves its snapshot copies, the job restores step 5 from peer memory onto the one
    actor at hand, grows a replica group back (peer to peer), then reshapes to the configured mesh
    from the boundary's snapshot as new actors come: ranks 1, 2 and 3 added, no step lost."""
    fake_cluster.hosts = {"n0", "n1"}
    fake_cluster.capacity = ["n2", "n3", "n3"]
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=30",
        faults=("node@5:2",),
        script={
            "snapshots": True,
            "nodes": TWO_NODES,
            "runs": {
                1: {"steps_done": 5, "held": "all", "stuck": {1}},
                2: {"steps_done": 9, "held": "all"},
                3: {"steps_done": 13, "held": "all"},
            },
        },
    )
    assert_finished(finish(controller), tmp_path, 30)
    assert steps(tmp_path) == list(range(1, 31))
    failure = only(events_of(tmp_path, "failure"))
    assert (failure["kind"], failure["ranks"]) == ("node_lost,stuck", [1, 2, 3])
    restored = events_of(tmp_path, "restored")
    assert [(r["source"], r["step"]) for r in restored] == [("peer_memory", 5), ("peer_memory", 13)]
    recovered = only(events_of(tmp_path, "recovered"))
    assert recovered["lost_steps"] == 0 and recovered["source"] == "peer_memory"
    grows = events_of(tmp_path, "grow")
    assert sorted(rank for grow in grows for rank in grow["added_ranks"]) == [1, 2, 3]
    assert grows[-1]["new_mesh"] == recovered["old_mesh"]
    assert events_of(tmp_path)[-1]["replicas_consistent"] is True


# ---------------------------------------------------------------------------- tests/faults/test_chaos.py
def test_a_chaos_schedule_is_recorded_and_handed_to_the_ranks(make_controller, tmp_path):
    """The run records its seed's schedule (the ``fault_schedule`` event a failing seed is replayed
    from) and hands every rank fault to the first generation's ranks."""
    schedule = chaos_schedule(
        7, 6, steps=30, world_size=4, replica_size=2, kinds=chaos_kinds(storage=True, nodes=False)
    )
    described = [fault.describe() for fault in schedule]
    controller = make_controller(*ELASTIC_LAYOUT, "training.steps=30", faults=tuple(described), chaos_seed=7)
    controller.step()
    recorded = only(events_of(tmp_path, "fault_schedule"))
    assert recorded["seed"] == 7 and recorded["faults"] == described
    assert fake_group(controller).configured[0]["faults"] == described


def test_overlapping_faults_each_recover_and_are_each_spent_once(make_controller, fake_cluster, tmp_path):
    """A chaos-like run on the fake group: rank 3 killed in step 4 (its replica group refilled from
    the spares), a SIGTERM to rank 0 at step 8 (its replica group leaves at the boundary, refilled
    from the warm actors left), rank 0 raising in step 12 (no warm actors left: the job shrinks).
    One failure or drain per fault, each spent once, each step once, no step lost."""
    fake_cluster.hosts = {"n0"}
    sigterm = DrainNoticeReport(rank=0, time=0.0, reason="SIGTERM", scope=NoticeScope.PROCESS)
    raised = RunOutcome(RunStatus.FAILED, 11, error="InjectedFault: raise@12:0", failure_kind=FailureKind.INJECTED)
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=16",
        "elastic.spare_actors=2",
        faults=("kill@4:3", "sigterm@8:0", "raise@12:0"),
        script={
            "snapshots": True,
            "nodes": ["n0"] * 6,
            "runs": {
                1: {"steps_done": 3, "held": "all", "outcomes": {3: DIED}},
                2: {"steps_done": 8, "held": "all", "reports": {0: [sigterm]}},
                3: {"steps_done": 11, "held": "all", "outcomes": {0: raised}},
            },
        },
    )
    assert_finished(finish(controller), tmp_path, 16)
    assert steps(tmp_path) == list(range(1, 17))
    assert [(e["kind"], e["ranks"]) for e in events_of(tmp_path, "failure")] == [
        ("rank_died", [3]),
        ("rank_error", [0]),
    ]
    assert only(events_of(tmp_path, "drain"))["ranks"] == [0]
    recoveries = events_of(tmp_path, "recovered")
    assert [(e["cause"], e["new_mesh"]["dp_replicate"], e["refilled_ranks"]) for e in recoveries] == [
        ("failure", 2, [2, 3]),
        ("drain", 2, [2, 3]),
        ("failure", 1, []),
    ]
    assert all(e["lost_steps"] == 0 for e in recoveries) and not events_of(tmp_path, "restored")
    configured = fake_group(controller).configured
    assert [c["faults"] for c in configured][-1] == []  # every fault spent once


# ----------------------------------------------------------------------------- tests/integration/*
def test_a_rank_lost_after_an_evaluation_leaves_one_eval_event_per_boundary(make_controller, tmp_path):
    """A job evaluating every 5 steps: rank 3 dies at the start of step 6; the survivors resume at
    boundary 5 and evaluate it again; the driver keeps the first event."""
    controller = make_controller(
        *ELASTIC_LAYOUT,
        "training.steps=12",
        "eval.interval_steps=5",
        script={
            "runs": {
                1: {"steps_done": 5, "held": "all", "outcomes": {3: DIED}, "reports": {0: [eval_report(5)]}},
                2: {"reports": {0: [eval_report(5), eval_report(10), eval_report(12)]}},
            }
        },
    )
    assert_finished(finish(controller), tmp_path, 12)
    assert only(events_of(tmp_path, "failure"))["ranks"] == [3]
    assert [e["step"] for e in events_of(tmp_path, "eval")] == [5, 10, 12]
    assert steps(tmp_path) == list(range(1, 13))


def test_a_mesh_the_cluster_cannot_place_ends_the_run_failed_with_the_error(make_controller, tmp_path):
    """test_train_cli: the group's start raises (too many ranks, actors that cannot start); the run
    raises that error and its record ends with a failed ``done``."""
    error = ConfigError("parallelism: dp_replicate=1 x pp=1 x dp_shard=2 x tp=1 cannot be placed: 2 ranks need 8 CPUs")
    controller = make_controller(*SINGLE_REPLICA, script={"start_error": error})
    with pytest.raises(ConfigError, match="cannot be placed"):
        controller.run()
    done = events_of(tmp_path)[-1]
    assert done["event"] == "done" and done["status"] == "failed" and "cannot be placed" in done["reason"]
    assert fake_group(controller).shut_down


def test_a_second_incident_past_the_failure_budget_ends_the_run(make_controller, tmp_path):
    """Incidents, not attempts, count against elastic.max_failures: two ranks lost at steps apart
    are two incidents, and with max_failures=1 the second ends the run, saying why."""
    controller = make_controller(
        "parallelism.dp_replicate=4",
        "parallelism.dp_shard=1",
        "training.steps=10",
        "elastic.max_failures=1",
        script={
            "runs": {
                1: {"steps_done": 2, "held": "all", "outcomes": {3: DIED}},
                2: {"steps_done": 5, "held": "all", "outcomes": {1: DIED}},
            }
        },
    )
    final = finish(controller)
    assert (final.status, final.exit_code) == ("failed", 1)
    assert final.reason == (
        "2 failures within 3600 s exceed the failure budget (elastic.max_failures=1, elastic.failure_window_s=3600)"
    )
    assert [e["ranks"] for e in events_of(tmp_path, "failure")] == [[3], [1]]
    assert events_of(tmp_path)[-1]["status"] == "failed"
