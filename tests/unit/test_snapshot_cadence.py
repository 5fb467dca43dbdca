"""How often peer-memory snapshots are taken: the cadence's arithmetic, and the commit vote that
makes every rank follow the interval the driver publishes (a real store, no Ray)."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elastic.snapshot_cadence import MAX_INTERVAL, WINDOW, SnapshotCadence
from workers.rendezvous import StepCommitter, StoreHost
from workers.spec import StepDecision, Verdict


# ------------------------------------------------------------------ the cadence
def test_without_a_limit_the_configured_interval_never_changes():
    cadence = SnapshotCadence(3, overhead_limit=0.0)
    assert cadence.observe(3, 50.0) is None and cadence.interval == 3
    assert SnapshotCadence(0, overhead_limit=0.02).observe(1, 50.0) is None  # snapshots off


def test_the_interval_keeps_the_overhead_within_the_limit_and_never_goes_below_the_configured_one():
    cadence = SnapshotCadence(1, overhead_limit=0.02)
    assert cadence.observe(1, 0.01) is None  # half the limit at every step: every step it stays
    assert cadence.observe(2, 0.13) is None  # step 2's other ranks may not have reported yet
    assert cadence.observe(3, 0.13) == 4  # median of 0.01 and 0.13 = 0.07: ceil(0.07 / 0.02) = 4
    assert cadence.observe(4, 0.13) == 7  # median 0.13: 7
    assert SnapshotCadence(10, overhead_limit=0.02).interval_for(0.05) == 10  # 3 would do; 10 was asked
    assert SnapshotCadence(1, overhead_limit=0.02).interval_for(0.04) == 2  # exactly the limit at 2
    assert SnapshotCadence(1, overhead_limit=0.02).interval_for(500.0) == MAX_INTERVAL


def test_one_slow_snapshot_does_not_move_the_interval_but_a_lasting_change_does():
    cadence = SnapshotCadence(1, overhead_limit=0.1)
    for step in range(1, WINDOW + 2):
        cadence.observe(step, 0.25)
    assert cadence.interval == 3  # ceil(0.25 / 0.1)
    assert cadence.observe(10, 9.0) is None  # one slow copy (its buffers allocated, a busy node)
    assert cadence.observe(11, 0.25) is None
    for step in range(12, 12 + WINDOW + 1):
        cadence.observe(step, 0.05)
    assert cadence.interval == 1  # the steps got longer or the copies cheaper: back to every step


def test_the_interval_comes_down_only_with_a_margin_below_the_limit():
    cadence = SnapshotCadence(1, overhead_limit=0.1)
    for step in range(1, WINDOW + 2):
        cadence.observe(step, 0.25)
    for step in range(10, 10 + WINDOW + 1):  # 2 steps would cost 0.095 of a step: within the limit,
        cadence.observe(step, 0.19)  # but not within 0.8 of it
    assert cadence.interval == 3
    for step in range(20, 20 + WINDOW + 1):
        cadence.observe(step, 0.15)  # 2 steps: 0.075, within 0.8 of the limit
    assert cadence.interval == 2


def test_a_snapshot_costs_as_much_as_its_slowest_rank_says():
    cadence = SnapshotCadence(1, overhead_limit=0.1)
    cadence.observe(1, 0.05)
    cadence.observe(1, 0.45)  # another rank's report of the same snapshot
    assert cadence.observe(2, 0.05) == 5
    assert cadence.observe(2, 0.05) is None and cadence.interval == 5


# ----------------------------------------------------------- the decision in the store
@pytest.mark.parametrize(
    "decision",
    [
        StepDecision(Verdict.COMMIT),
        StepDecision(Verdict.COMMIT, snapshot=True),
        StepDecision(Verdict.COMMIT_PAUSE_CHECKPOINT, snapshot=True),
    ],
)
def test_a_decision_reads_back_as_written(decision):
    assert StepDecision.decode(decision.encode()) == decision


def test_a_value_that_is_no_decision_is_refused():
    assert StepDecision.decode(Verdict.ABORT) == StepDecision(Verdict.ABORT)
    with pytest.raises(ValueError, match=re.escape("not a step decision: 'commit+later'")):
        StepDecision.decode("commit+later")


def test_every_rank_snapshots_the_steps_the_vote_decides_and_follows_a_new_interval():
    store = dist.HashStore()
    committers = [StepCommitter(store, generation=0, world_size=2, timeout_s=10, snapshot_interval=2) for _ in range(2)]
    decisions: dict[int, list[StepDecision]] = {0: [], 1: []}

    def vote(rank: int, steps: range) -> None:
        decisions[rank].extend(committers[rank].vote(step) for step in steps)

    def vote_together(steps: range) -> None:
        threads = [threading.Thread(target=vote, args=(rank, steps)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=20)

    vote_together(range(1, 5))
    StoreHost.set_snapshot_interval(SimpleNamespace(store=store), 0, 3)  # the driver widens it
    vote_together(range(5, 10))
    assert decisions[0] == decisions[1]  # both ranks read one decision per step
    snapshotted = [step for step, decision in enumerate(decisions[0], start=1) if decision.snapshot]
    assert snapshotted == [2, 4, 6, 9]
    assert all(decision.verdict == Verdict.COMMIT for decision in decisions[0])


def test_a_pause_is_snapshotted_off_the_interval_and_a_pause_asked_before_the_ranks_joined_stands():
    store = dist.HashStore()
    StoreHost.request_pause(SimpleNamespace(store=store), 4)  # the driver was first
    committer = StepCommitter(store, generation=4, world_size=1, timeout_s=10, snapshot_interval=5)
    assert committer.vote(1) == StepDecision(Verdict.COMMIT_AND_PAUSE, snapshot=True)
    unsnapshotted = StepCommitter(store, generation=5, world_size=1, timeout_s=10, snapshot_interval=0)
    StoreHost.request_pause(SimpleNamespace(store=store), 5, checkpoint=True)
    assert unsnapshotted.vote(1) == StepDecision(Verdict.COMMIT_PAUSE_CHECKPOINT)  # snapshots off: none
