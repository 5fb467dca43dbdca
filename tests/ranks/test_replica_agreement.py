"""Replica groups agree bit for bit: a refill from replica group 0 copies its state exactly in
bounded broadcasts, every replica clips by replica group 0's gradient norm, and with
accumulation the gradients cross replica groups once per step.

Two spawned processes on real gloo (``tests/ranks/replica_ranks.py``), one rank per replica group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks.replica_ranks import SPEC, SYNC_CAP_BYTES, run_rank
from tests.ranks.spawned_ranks import spawn_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, tuple[Any, ...]]:
    return spawn_ranks(run_rank, world_size=2, store_path=str(tmp_path_factory.mktemp("store") / "store"))


def assert_equal_states(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert left.keys() == right.keys()
    unequal = [name for name in left if not torch.equal(torch.from_numpy(left[name]), torch.from_numpy(right[name]))]
    assert not unequal, f"differ: {unequal[:5]}"


def test_a_refilled_replica_holds_replica_zeros_state_bit_for_bit(ranks):
    before_sync, after_sync, _, _, _, _ = ranks[0]
    _, refilled, _, _, _, _ = ranks[1]
    assert_equal_states(after_sync, before_sync)
    assert_equal_states(refilled, before_sync)


def test_the_refill_broadcasts_in_bounded_chunks(ranks):
    broadcasts = ranks[0][2]
    assert len(broadcasts) > 1
    assert max(broadcasts) <= SYNC_CAP_BYTES


def test_every_replica_clips_by_replica_zeros_norm(ranks):
    _, _, _, norm_0, state_0, _ = ranks[0]
    _, _, _, norm_1, state_1, _ = ranks[1]
    assert norm_1 == norm_0
    assert_equal_states(state_1, state_0)


def test_gradients_cross_replica_groups_once_per_step(ranks):
    fsdp_modules = SPEC.model.n_layers + 1  # each block and the stage root
    assert SPEC.microbatches > 1
    assert ranks[0][5] == fsdp_modules
