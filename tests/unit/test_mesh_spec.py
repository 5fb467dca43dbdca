"""MeshSpec: rank arithmetic, replica groups, and the numbers in its errors."""

from __future__ import annotations

import dataclasses

import pytest

from elastic.spec import DIM_ORDER, MeshError, MeshSpec, RankCoords
from workers.spec import PRESETS


def test_rank_coords_round_trip_in_dim_order():
    mesh = MeshSpec(dp_replicate=2, dp_shard=3, tp=2, pp=2)
    assert mesh.world_size == 24 and mesh.dp == 6 and mesh.replica_size == 12
    seen = set()
    for rank in range(mesh.world_size):
        coords = mesh.coords(rank)
        assert mesh.rank(coords) == rank
        seen.add((coords.dp_replicate, coords.pp, coords.dp_shard, coords.cp, coords.tp))
    assert len(seen) == 24
    # tp is innermost: consecutive ranks form a tensor-parallel group.
    assert [mesh.coords(r).tp for r in range(4)] == [0, 1, 0, 1]
    assert mesh.shape == (2, 2, 3, 1, 2) and DIM_ORDER[0] == "dp_replicate"


def test_replica_groups_are_contiguous_blocks():
    mesh = MeshSpec(dp_replicate=3, dp_shard=2, tp=2, pp=1)
    groups = mesh.replica_groups()
    assert [g.ranks for g in groups] == [tuple(range(0, 4)), tuple(range(4, 8)), tuple(range(8, 12))]
    assert all(mesh.replica_of(r) == g.index for g in groups for r in g.ranks)


def test_dropping_a_replica_keeps_every_survivors_slice():
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    smaller = mesh.with_replicas(1)
    for rank in mesh.replica_groups()[1].ranks:
        old = mesh.coords(rank)
        new = smaller.coords(smaller.rank(RankCoords(0, old.pp, old.dp_shard, old.tp)))
        assert (new.pp, new.dp_shard, new.tp) == (old.pp, old.dp_shard, old.tp)


def test_dp_rank_orders_replicas_then_shards():
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=2)
    assert sorted({mesh.dp_rank(r) for r in range(mesh.world_size)}) == [0, 1, 2, 3]
    assert mesh.dp_rank(mesh.rank(RankCoords(1, 0, 1, 0))) == 3


def test_bad_degrees_are_named():
    with pytest.raises(MeshError, match=r"tp=0"):
        MeshSpec(tp=0)
    with pytest.raises(MeshError, match=r"rank 8 outside 0..7"):
        MeshSpec(dp_shard=8).coords(8)


def test_check_divides_lists_numbers():
    problems = MeshSpec(tp=3, pp=3, dp_shard=5).check_divides(
        n_heads=4, n_kv_heads=2, n_layers=4, ffn_dim=192, global_batch=16, microbatches=4, seq_len=128
    )
    assert "tp=3 must divide model.n_heads=4" in problems
    assert any("3 pipeline stages must divide model.n_layers=4" in p for p in problems)
    assert any("= 20 must divide training.global_batch=16" in p for p in problems)


def test_tensor_parallel_splits_a_dense_mlp_but_not_a_mixture_of_experts():
    """A moe block stays whole on every tp rank, so tp need not divide its widths."""
    moe = dataclasses.replace(PRESETS["debug-moe"], ffn_dim=191)
    dense = dataclasses.replace(PRESETS["debug"], ffn_dim=191)
    assert moe.tp_split_ffn_dim is None and dense.tp_split_ffn_dim == 191
    shape = {"n_heads": 4, "n_kv_heads": 2, "n_layers": 4, "global_batch": 16, "microbatches": 1, "seq_len": 128}
    mesh = MeshSpec(dp_shard=2, tp=2)
    assert mesh.check_divides(ffn_dim=moe.tp_split_ffn_dim, **shape) == []
    assert mesh.check_divides(ffn_dim=dense.tp_split_ffn_dim, **shape) == ["tp=2 must divide model.ffn_dim=191"]
