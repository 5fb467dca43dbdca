"""Training with context parallelism (``parallelism.cp``) on any mesh with cp > 1 matches one
rank, under every ``parallelism.cp_method``: the same losses over 10 steps, the same logits, the
same evaluation loss.

Spawned processes on real gloo (``tests/ranks/cp_ranks.py``); how the sequence is split and the
mesh laid out: tests/unit/test_context_parallel.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from elastic.spec import CpMethod, MeshSpec
from tests.marks import slow_when_named
from tests.ranks import cp_ranks
from tests.ranks.spawned_ranks import commit_step, spawn_ranks
from workers.spec import PRESETS

LAYOUTS = {
    "cp2": (MeshSpec(dp_shard=1, cp=2), False, CpMethod.ALLGATHER),
    "cp2-tp2": (MeshSpec(dp_shard=1, cp=2, tp=2), False, CpMethod.ALLGATHER),
    "pp2-cp2": (MeshSpec(dp_shard=1, cp=2, pp=2), False, CpMethod.ALLGATHER),
    "dp_replicate2-cp2": (MeshSpec(dp_replicate=2, dp_shard=1, cp=2), False, CpMethod.ALLGATHER),
    # Recomputation runs the K/V all-gather again inside the backward.
    "cp2-activation_checkpointing": (MeshSpec(dp_shard=1, cp=2), True, CpMethod.ALLGATHER),
    # The debug preset's 2 key/value heads: split over cp=2, repeated per rank at cp=4 and with tp=2.
    "ulysses-cp2": (MeshSpec(dp_shard=1, cp=2), False, CpMethod.ULYSSES),
    "ulysses-cp4": (MeshSpec(dp_shard=1, cp=4), False, CpMethod.ULYSSES),
    "ulysses-cp2-tp2": (MeshSpec(dp_shard=1, cp=2, tp=2), False, CpMethod.ULYSSES),
    "ring-cp2": (MeshSpec(dp_shard=1, cp=2), False, CpMethod.RING),
    "ring-cp2-tp2": (MeshSpec(dp_shard=1, cp=2, tp=2), False, CpMethod.RING),
}


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory):
    store = tmp_path_factory.mktemp("single") / "store"
    mesh = MeshSpec(dp_shard=1)
    return spawn_ranks(functools.partial(cp_ranks.run_rank, mesh=mesh), world_size=1, store_path=str(store))[0]


# cp2-tp2 (about 20 s on 2 cores, the others 6-9 s) combines two axes the others cover, and cp4
# (four ranks) repeats cp2 with more of them: CI runs them (make test-all), make test not; make
# test keeps one cp2 case per method. Ring at cp=4: the checkpoint test's saving run below.
SLOW = {"cp2-tp2", "ulysses-cp4", "ulysses-cp2-tp2", "ring-cp2-tp2"}


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


@pytest.mark.slow  # six ranks in two runs, about 10 s on 2 cores
def test_a_checkpoint_written_at_cp4_ring_restores_into_cp2_ulysses_and_trains_on_alike(single_rank_run, tmp_path):
    """The state does not depend on the cp method: saved with ring attention over cp=4 (whose 10
    steps match one rank's), restored bitwise over cp=2 with Ulysses, the steps after it train as
    the saving run's did."""
    ckpt, saved_mesh, mesh = tmp_path / "ckpt", MeshSpec(dp_shard=1, cp=4), MeshSpec(dp_shard=1, cp=2)
    saved = spawn_ranks(
        functools.partial(cp_ranks.save_rank, mesh=saved_mesh, cp_method=CpMethod.RING, ckpt_dir=str(ckpt)),
        world_size=saved_mesh.world_size,
        store_path=str(tmp_path / "saving"),
    )
    saved_losses = next(losses for _, _, losses in saved.values() if losses[0] is not None)
    assert saved_losses == pytest.approx(single_rank_run[0], rel=1e-3)
    reports = [report for report, _, _ in saved.values()]
    commit_step(str(ckpt), reports, step=cp_ranks.SAVED_AT, mesh=saved_mesh, model=PRESETS["debug"].to_dict())
    restored = spawn_ranks(
        functools.partial(cp_ranks.restore_rank, mesh=mesh, cp_method=CpMethod.ULYSSES, ckpt_dir=str(ckpt)),
        world_size=mesh.world_size,
        store_path=str(tmp_path / "restoring"),
    )
    _, saved_state, _ = saved[0]
    for state, losses in restored.values():
        assert sorted(state) == sorted(saved_state) and any(name.startswith("optim.") for name in state)
        assert [name for name in state if not np.array_equal(state[name], saved_state[name])] == []
        if losses[0] is not None:
            assert losses == pytest.approx(saved_losses[cp_ranks.SAVED_AT :], rel=1e-3)
