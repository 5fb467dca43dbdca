"""Context parallelism (``parallelism.cp``): each rank holds two of ``2 x cp`` chunks of every
sequence, masks by global position, and cp sits between dp_shard and tp in the mesh.

Training on meshes with cp > 1 against one rank: tests/ranks/test_context_parallel_training.py.
"""

from __future__ import annotations

import pytest
import torch

from elastic.policy import restore_mesh
from elastic.spec import MeshError, MeshSpec, RankCoords
from workers.context_parallel import WHOLE_SEQUENCE, SequenceShard


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


def test_a_world_of_another_size_is_refused_naming_every_degree():
    with pytest.raises(MeshError) as refused:
        MeshSpec(dp_shard=2, cp=2, tp=2).check_world_size(6)
    assert str(refused.value) == "dp_replicate=1 x pp=1 x dp_shard=2 x cp=2 x tp=2 = 8 ranks, but the world has 6"


def test_a_restore_onto_fewer_ranks_gives_up_dp_shard_and_keeps_cp():
    configured = MeshSpec(dp_shard=2, cp=2, tp=2)
    assert restore_mesh(configured, available_ranks=7, fits=lambda mesh: True) == MeshSpec(dp_shard=1, cp=2, tp=2)
    assert configured.with_replicas(2) == MeshSpec(dp_replicate=2, dp_shard=2, cp=2, tp=2)
