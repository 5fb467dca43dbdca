"""The failure policy's budget: incidents count, their echoes and faults during their recovery do not."""

from __future__ import annotations

from elastic.policy import Fail, FailurePolicy, GroupStatus, RestoreFromCheckpoint, Shrink
from elastic.spec import MeshSpec

MESH = MeshSpec(dp_replicate=4, dp_shard=2, tp=1, pp=1)


def decide(policy: FailurePolicy, *, lost: int, completed: int, at: float):
    status = GroupStatus(mesh=MESH, lost_ranks=frozenset({lost}), time=at, completed_step=completed)
    return policy.decide(status, fits=lambda mesh: True, restore_mesh=lambda: MESH)


def test_losses_with_no_step_completed_in_between_are_one_incident():
    policy = FailurePolicy(max_failures=2)
    assert isinstance(decide(policy, lost=0, completed=10, at=0.0), Shrink)
    # a fault during the recovery, then a late echo: still the first incident
    assert isinstance(decide(policy, lost=2, completed=10, at=1.0), Shrink)
    assert policy.failure_times == [0.0] and policy.attempts == 2
    assert isinstance(decide(policy, lost=4, completed=11, at=2.0), Shrink)  # a step later: a new incident
    assert isinstance(decide(policy, lost=6, completed=12, at=3.0), Fail)  # the third incident: over budget


def test_an_incident_whose_recovery_keeps_failing_ends_the_run_after_max_failures_attempts():
    policy = FailurePolicy(max_failures=3)
    decisions = [decide(policy, lost=rank % 8, completed=5, at=float(rank)) for rank in range(4)]
    assert [type(d) for d in decisions] == [Shrink, Shrink, Shrink, Fail]
    reason = decisions[-1].reason
    assert reason == "recovery failed 4 times in a row without completing a step after step 5 (elastic.max_failures=3)"


def test_the_budget_window_forgets_old_incidents():
    policy = FailurePolicy(max_failures=1, window_s=10.0)
    assert isinstance(decide(policy, lost=0, completed=1, at=0.0), Shrink)
    assert isinstance(decide(policy, lost=0, completed=2, at=20.0), Shrink)  # the first is out of the window
    over = decide(policy, lost=0, completed=3, at=25.0)
    assert isinstance(over, Fail) and over.reason.startswith("2 failures within 10 s exceed the failure budget")


def test_a_refill_stops_at_max_replicas():
    status = GroupStatus(mesh=MESH, lost_ranks=frozenset({0}), warm_actors=8, time=0.0)
    decision = FailurePolicy(max_replicas=3).decide(status, fits=lambda mesh: True, restore_mesh=lambda: MESH)
    assert decision == Shrink(MESH.with_replicas(3), drop=(0,), refill=0)


def test_survivors_that_fit_nowhere_restore_and_a_restore_that_fits_nowhere_fails():
    one = MeshSpec(dp_replicate=1, dp_shard=2, tp=1, pp=1)
    status = GroupStatus(mesh=one, lost_ranks=frozenset({1}), time=0.0, checkpoint_step=4)
    decision = FailurePolicy().decide(status, fits=lambda mesh: False, restore_mesh=lambda: None)
    assert decision == Fail(
        "no complete replica group survived and the remaining resources cannot hold any mesh for this model and batch"
    )
    shrinking = GroupStatus(mesh=MESH, lost_ranks=frozenset({0}), time=0.0, checkpoint_step=4)
    restored = FailurePolicy().decide(shrinking, fits=lambda mesh: False, restore_mesh=lambda: one)
    assert restored == RestoreFromCheckpoint(step=4, new_mesh=one)
