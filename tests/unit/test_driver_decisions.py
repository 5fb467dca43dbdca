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

from orchestrator.driver.calls import CallFailed, CallFailedKind
from tests.unit.fake_group import DIED, ELASTIC, events_of, fake_group, finish, replicas_on, starts_of
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
