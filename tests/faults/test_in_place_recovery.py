"""A rank is killed, raises, or hangs: the job shrinks in place (or refills from warm spares)
and finishes with zero completed steps lost and the losses of an uninterrupted run."""

from __future__ import annotations

import pytest

from tests.faults.harness import ELASTIC_LAYOUT, assert_completed_like, of_kind, run_job
from tests.jobs import losses, single_rank

STEPS = 10


@pytest.fixture(scope="module")
def reference(uninterrupted):
    """One uninterrupted process with the same model, data, sequences and global batch: every
    mesh these runs pass through trains like it (within the 1e-4 they assert), and it starts one
    actor where the 4-rank layout starts four."""
    return uninterrupted(*single_rank("training.seq_len=64", f"training.steps={STEPS}"))


@pytest.mark.parametrize(
    "fault, kind, rank",
    # make test keeps the SIGKILL; CI adds an exception raised in a rank's loop (it reaches the
    # driver as the rank's own error) and a hang (found from the ranks' real heartbeats, busy
    # against waiting in a collective). Their decisions: tests/unit/test_driver_decisions.py.
    [
        ("kill@4:3", "rank_died", 3),
        pytest.param("raise@4:1", "rank_error", 1, marks=pytest.mark.slow),
        pytest.param("hang@4:2", "hang", 2, marks=pytest.mark.slow),
    ],
    ids=["sigkill", "raise", "hang"],
)
def test_lost_rank_shrinks_in_place(fault, kind, rank, reference, tmp_path):
    result, events = run_job(tmp_path, *ELASTIC_LAYOUT, f"training.steps={STEPS}", faults=(fault,))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS)
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == kind and failure["ranks"] == [rank]
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0
    assert recovered["old_mesh"]["dp_replicate"] == 2
    # the replica group that lost a rank left whole; the other one went on without restarting
    assert recovered["new_mesh"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    if kind != "hang":  # a hang costs elastic.hang_timeout_s by definition
        assert recovered["mttr_s"] < 15


@pytest.mark.slow  # CI's tier: make test keeps the in-place shrink; the spares' choice is a fake-group test
def test_warm_spares_refill_the_lost_replica_with_identical_state_and_compile_nothing(reference, tmp_path):
    """With training.compile on: the refilled mesh is the layout the job started on, so its first
    step compiles nothing (the spares load the graphs from the job's caches); the compiled run's
    losses are the eager reference's."""
    result, events = run_job(
        tmp_path,
        *ELASTIC_LAYOUT,
        f"training.steps={STEPS}",
        "elastic.spare_actors=2",
        "training.compile=true",
        "parallelism.activation_checkpointing=true",  # recomputes the compiled block; changes no loss
        f"runtime.compile_cache_dir={tmp_path / 'compile-cache'}",
        faults=("kill@4:2",),
    )
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS)
    [recovered] = of_kind(events, "recovered")
    assert recovered["new_mesh"]["dp_replicate"] == 2  # refilled, not shrunk
    assert recovered["refilled_ranks"] == [2, 3]
    assert events[-1]["replicas_consistent"] is True
    [first] = of_kind(events, "step")[:1]
    assert first["compile"]["compiled"] > 0  # the first generation compiled the block's graphs
    [failure] = of_kind(events, "failure")
    refilled = next(e for e in events[events.index(failure) :] if e["event"] == "step")
    assert refilled["compile"]["compiled"] == 0
    # The spares loaded the graphs from the job's cache; the survivors kept theirs in memory (tp=1).
    assert refilled["compile"]["cache_hits"] > 0


@pytest.mark.slow  # the rank's SIGTERM handler; CI runs this
def test_sigterm_to_one_rank_on_a_single_node_leaves_its_replica_group_only(reference, tmp_path):
    """Regression: on the one-node embedded cluster, SIGTERM to one rank process drained the node,
    so every replica group, then waited for capacity that could not come and failed the run."""
    result, events = run_job(tmp_path, *ELASTIC_LAYOUT, f"training.steps={STEPS}", faults=("sigterm@4:1",))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS)
    assert not of_kind(events, "failure") and not of_kind(events, "restored")
    [drain] = of_kind(events, "drain")
    assert drain["ranks"] == [1] and drain["reason"] == "process told to end"
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1


# Two replica groups of a mixture of experts, each holding its experts over ep=2 (dp_shard=2)
# (the same decision with tp: tests/unit/test_driver_decisions.py). Its first steps take
# longer than the dense model's 8 s hang threshold on a busy 2-core machine.
MOE_LAYOUTS = {
    # rank 3: half of replica group 1's experts
    "ep2": ((*ELASTIC_LAYOUT, "model.preset=debug-moe", "parallelism.ep=2", "elastic.hang_timeout_s=30"), 3, "dp_shard")
}


@pytest.mark.slow  # two 4-rank MoE jobs: 40-50 s on 2 cores
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_a_killed_rank_of_a_moe_replica_group_recovers_in_place(layout, tmp_path):
    """An expert shard is state like any other: a rank of replica group 1 is killed, the job goes
    on in place on replica group 0 (the same degrees but dp_replicate), with the uninterrupted
    run's losses."""
    overrides, killed, kept_dim = MOE_LAYOUTS[layout]
    result, events = run_job(tmp_path / "uninterrupted", *overrides, f"training.steps={STEPS}")
    assert result.exit_code == 0, result.reason
    reference = losses(events)
    result, events = run_job(tmp_path / "killed", *overrides, f"training.steps={STEPS}", faults=(f"kill@4:{killed}",))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS, rel=1e-3)
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [killed]
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0
    assert (recovered["new_mesh"]["dp_replicate"], recovered["new_mesh"][kept_dim]) == (1, 2)


# Sequences split over cp=2 with ring attention in each of two replica groups; rank 3 is replica
# group 1's second cp rank.
CP_RING_LAYOUT = (*ELASTIC_LAYOUT, "parallelism.dp_shard=1", "parallelism.cp=2", "parallelism.cp_method=ring")


@pytest.mark.slow  # one 4-rank job; the in-place shrink itself is the sigkill case above
def test_a_killed_rank_of_a_cp2_ring_run_recovers_in_place_with_nothing_lost(reference, tmp_path):
    """A cp group is part of a replica group: losing one of its ranks drops that replica group and
    the other goes on in place, its ring intact, with the uninterrupted run's losses."""
    result, events = run_job(tmp_path, *CP_RING_LAYOUT, f"training.steps={STEPS}", faults=("kill@4:3",))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS, rel=1e-3)
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [3]
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0
    assert recovered["new_mesh"] == {"dp_replicate": 1, "pp": 1, "dp_shard": 1, "cp": 2, "tp": 1}
