"""Training with context parallelism (``parallelism.cp``) on any mesh with cp > 1 matches one
rank, under every ``parallelism.cp_method``: the same losses over 10 steps, the same logits, the
same evaluation loss.

Spawned processes on real gloo (``tests/ranks/cp_ranks.py``); how the sequence is split and the
mesh laid out: tests/unit/test_context_parallel.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from elastic.spec import CpMethod, MeshSpec
from tests.marks import slow_when_named
from tests.ranks import cp_ranks
from tests.ranks.spawned_ranks import spawn_ranks

LAYOUTS = {
    "cp2": (MeshSpec(dp_shard=1, cp=2), False, CpMethod.ALLGATHER),
    "cp2-tp2": (MeshSpec(dp_shard=1, cp=2, tp=2), False, CpMethod.ALLGATHER),
    "pp2-cp2": (MeshSpec(dp_shard=1, cp=2, pp=2), False, CpMethod.ALLGATHER),
    "dp_replicate2-cp2": (MeshSpec(dp_replicate=2, dp_shard=1, cp=2), False, CpMethod.ALLGATHER),
    # Recomputation runs the K/V all-gather again inside the backward.
    "cp2-activation_checkpointing": (MeshSpec(dp_shard=1, cp=2), True, CpMethod.ALLGATHER),
    "cp4": (MeshSpec(dp_shard=1, cp=4), False, CpMethod.ALLGATHER),
    # The debug preset's 2 key/value heads: split over cp=2, repeated per rank at cp=4 and with tp=2.
    "ulysses-cp2": (MeshSpec(dp_shard=1, cp=2), False, CpMethod.ULYSSES),
    "ulysses-cp4": (MeshSpec(dp_shard=1, cp=4), False, CpMethod.ULYSSES),
    "ulysses-cp2-tp2": (MeshSpec(dp_shard=1, cp=2, tp=2), False, CpMethod.ULYSSES),
}


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory):
    store = tmp_path_factory.mktemp("single") / "store"
    mesh = MeshSpec(dp_shard=1)
    return spawn_ranks(functools.partial(cp_ranks.run_rank, mesh=mesh), world_size=1, store_path=str(store))[0]


# cp2-tp2 (about 20 s on 2 cores, the others 6-9 s) combines two axes the others cover, and cp4
# (four ranks) repeats cp2 with more of them: CI runs them (make test-all), make test not; make
# test keeps one cp2 case per method.
SLOW = {"cp2-tp2", "cp4", "ulysses-cp4", "ulysses-cp2-tp2"}


@pytest.mark.parametrize("layout", slow_when_named(LAYOUTS, SLOW))
def test_training_with_cp_matches_one_rank(layout, single_rank_run, tmp_path):
    mesh, activation_checkpointing, cp_method = LAYOUTS[layout]
    ranks = spawn_ranks(
        functools.partial(
            cp_ranks.run_rank, mesh=mesh, activation_checkpointing=activation_checkpointing, cp_method=cp_method
        ),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "s"),
    )
    expected_losses, expected_logits, expected_eval = single_rank_run
    # One rank per data-parallel slice reports the loss over its whole sequences.
    reported = [losses for losses, _, _ in ranks.values() if losses[0] is not None]
    assert len(reported) == mesh.dp
    assert [sum(step) / mesh.dp for step in zip(*reported)] == pytest.approx(expected_losses, rel=1e-3)
    assert expected_losses[-1] < expected_losses[0]
    last_stage = [rank for rank in range(mesh.world_size) if mesh.coords(rank).pp == mesh.pp - 1]
    for rank in last_stage:
        torch.testing.assert_close(
            torch.from_numpy(ranks[rank][1]), torch.from_numpy(expected_logits), rtol=0, atol=1e-5
        )
    assert {round(evaluation, 5) for _, _, evaluation in ranks.values()} == {round(expected_eval, 5)}
