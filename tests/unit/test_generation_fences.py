"""Ranks cut off by a partition come back to a job that moved on: what they send must not count.

The driver found their node lost, vetoed the step in flight and went on in a new generation
(tests/unit/test_network_faults.py; for real: tests/faults/test_separate_networks.py). Every path
an old rank has, and its fence:

* the commit vote (job store): keys are prefixed by generation, and the driver's veto of the old
  generation's undecided step wins the compare-and-set: a late voter reads ``abort`` and applies
  nothing (below);
* a peer-memory snapshot copied to its buddy: refused by a holder already in a newer generation
  (below), so it neither counts for a restore nor displaces newer copies;
* reports to the driver (steps, checkpoint shards, the sample ledger fed by step reports): the
  driver polls only the active ranks of the current mesh, so a removed rank's reports are never
  read; checkpoint reports are also matched to the generation saving the step
  (checkpointing/commit.py, tests/unit/test_ckpt_commit.py), and shard objects carry a random
  suffix, so a late upload overwrites nothing a manifest names;
* the actors themselves: killed by the driver when it declares the node lost; Ray ends them once
  the node answers again.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from workers.actor import RankActor
from workers.peer_snapshots import SnapshotStore, StaleSnapshotError
from workers.rendezvous import StepCommitter, StoreHost
from workers.spec.train import Verdict


class _Host:
    """``StoreHost``'s driver-side calls over an in-process store (no Ray)."""

    def __init__(self, store) -> None:
        self.store = store

    abort_from = StoreHost.abort_from


def test_ranks_back_from_a_partition_read_the_driver_veto_and_apply_nothing():
    store = dist.HashStore()
    old = 3
    # Generation 3 (4 ranks) at step 7: the survivors 0 and 1 voted; 2 and 3 are cut off.
    committers = [StepCommitter(store, generation=old, world_size=4, timeout_s=1.0) for _ in range(4)]
    for _ in range(2):
        store.add(f"gen{old}/step/7/ready", 1)
    # The driver declares 2 and 3 lost, vetoes the step in flight and starts generation 4.
    assert _Host(store).abort_from(old, 7) == 7
    StepCommitter(store, generation=old + 1, world_size=2, timeout_s=1.0)
    # The partition heals: the old ranks vote, the last of them completing the count.
    assert committers[2].vote(7).verdict == Verdict.ABORT
    assert committers[3].vote(7).verdict == Verdict.ABORT
    assert not store.check([f"gen{old + 1}/step/7"])  # nothing of theirs in the new generation's keys


def _holder(generation: int) -> tuple[RankActor, list]:
    """A rank actor with only what holding a peer's snapshot reads (no Ray)."""
    actor = RankActor.__new__(RankActor)
    actor.generation = generation
    actor.snapshot_store = SnapshotStore()
    sent: list = []
    actor.channel = type("Channel", (), {"send": staticmethod(sent.append)})()
    return actor, sent


def test_a_buddy_in_a_newer_generation_refuses_an_old_rank_snapshot():
    holder, sent = _holder(generation=4)
    with pytest.raises(StaleSnapshotError, match="generation 3 refused: this actor is in generation 4"):
        holder.keep_snapshot("memory/g000003/step-00000007/rank-00002", 3, 7, 2, b"old state")
    assert not holder.snapshot_store.holds("memory/g000003/step-00000007/rank-00002") and not sent
    holder.keep_snapshot("memory/g000004/step-00000008/rank-00001", 4, 8, 1, b"new state")
    assert holder.snapshot_store.holds("memory/g000004/step-00000008/rank-00001") and len(sent) == 1
