"""Context parallelism (``parallelism.cp``): each rank holds two of ``2 x cp`` chunks of every
sequence, and training on any mesh with cp > 1 matches one rank: the same losses over 10 steps,
the same logits, the same evaluation loss.

Spawned processes on real gloo (``tests/unit/cp_ranks.py``).
"""

from __future__ import annotations

import functools

import pytest
import torch

from elastic.policy import restore_mesh
from elastic.spec import MeshError, MeshSpec, RankCoords
from tests.marks import slow_when_named
from tests.unit import cp_ranks
from tests.unit.spawned_ranks import spawn_ranks
from workers.context_parallel import WHOLE_SEQUENCE, SequenceShard

LAYOUTS = {
    "cp2": (MeshSpec(dp_shard=1, cp=2), False),
    "cp2-tp2": (MeshSpec(dp_shard=1, cp=2, tp=2), False),
    "pp2-cp2": (MeshSpec(dp_shard=1, cp=2, pp=2), False),
    "dp_replicate2-cp2": (MeshSpec(dp_replicate=2, dp_shard=1, cp=2), False),
    # Recomputation runs the K/V all-gather again inside the backward.
    "cp2-activation_checkpointing": (MeshSpec(dp_shard=1, cp=2), True),
}


def test_each_cp_rank_keeps_an_early_and_a_late_chunk():
    sequence = torch.arange(16).unsqueeze(0)
    parts = [SequenceShard(cp=2, cp_rank=rank).take(sequence) for rank in range(2)]
    assert parts[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert parts[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert SequenceShard(cp=2, cp_rank=1).positions(8, torch.device("cpu")).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert WHOLE_SEQUENCE.take(sequence) is sequence


def test_causal_mask_is_by_global_position():
    mask = SequenceShard(cp=2, cp_rank=0).causal_mask(4, torch.device("cpu"))
    assert mask.shape == (4, 8)
    assert mask[1].tolist() == [True, True, False, False, False, False, False, False]  # position 1
    assert mask[2].tolist() == [True] * 7 + [False]  # position 6


def test_cp_sits_between_dp_shard_and_tp_and_inside_a_replica_group():
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, cp=2, tp=2)
    assert mesh.world_size == 16 and mesh.dp == 4 and mesh.replica_size == 8 and mesh.fsdp_shards == 4
    assert mesh.coords(3) == RankCoords(dp_replicate=0, pp=0, dp_shard=0, cp=1, tp=1)
    assert mesh.replica_groups()[1].ranks == tuple(range(8, 16))
    # cp ranks take the same samples: the data-parallel rank ignores cp.
    assert {mesh.dp_rank(rank) for rank in range(4)} == {0}
    assert mesh.describe() == "dp_replicate=2 x pp=1 x dp_shard=2 x cp=2 x tp=2"


def test_a_mesh_written_before_cp_loads_with_cp_1():
    assert MeshSpec.from_dict({"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}) == MeshSpec(dp_shard=2, tp=2)
    assert MeshSpec.from_dict(MeshSpec(cp=4).as_dict()).cp == 4


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory):
    store = tmp_path_factory.mktemp("single") / "store"
    mesh = MeshSpec(dp_shard=1)
    return spawn_ranks(functools.partial(cp_ranks.run_rank, mesh=mesh), world_size=1, store_path=str(store))[0]


# cp2-tp2 (about 20 s on 2 cores, the others 6-9 s) combines two axes the others cover: CI runs it
# (make test-all), make test not.
@pytest.mark.parametrize("layout", slow_when_named(LAYOUTS, {"cp2-tp2"}))
def test_training_with_cp_matches_one_rank(layout, single_rank_run, tmp_path):
    mesh, activation_checkpointing = LAYOUTS[layout]
    ranks = spawn_ranks(
        functools.partial(cp_ranks.run_rank, mesh=mesh, activation_checkpointing=activation_checkpointing),
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


def test_a_world_of_another_size_is_refused_naming_every_degree():
    with pytest.raises(MeshError) as refused:
        MeshSpec(dp_shard=2, cp=2, tp=2).check_world_size(6)
    assert str(refused.value) == "dp_replicate=1 x pp=1 x dp_shard=2 x cp=2 x tp=2 = 8 ranks, but the world has 6"


def test_a_restore_onto_fewer_ranks_gives_up_dp_shard_and_keeps_cp():
    configured = MeshSpec(dp_shard=2, cp=2, tp=2)
    assert restore_mesh(configured, available_ranks=7, fits=lambda mesh: True) == MeshSpec(dp_shard=1, cp=2, tp=2)
    assert configured.with_replicas(2) == MeshSpec(dp_replicate=2, dp_shard=2, cp=2, tp=2)
