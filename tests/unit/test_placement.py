"""Placement: TP groups are bundles, replicas spread over nodes, shortfalls explained."""

from __future__ import annotations

from elastic.placement import NodeCapacity, RankResources, shortfall, spread_replicas, tp_bundles
from elastic.spec import MeshSpec


def test_one_bundle_per_tp_group():
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=4, pp=2)
    bundles = tp_bundles(mesh, RankResources(cpus=1, gpus=1))
    assert bundles == [{"CPU": 4, "GPU": 4}] * 4


def test_replicas_spread_over_nodes():
    nodes = [NodeCapacity("a", 8), NodeCapacity("b", 8), NodeCapacity("c", 8)]
    assert spread_replicas(3, RankResources(cpus=1), 4, nodes) == ["a", "b", "c"]
    # more replicas than nodes: wrap around, never stacking while an empty node is left
    assert sorted(spread_replicas(4, RankResources(cpus=1), 4, nodes)) == ["a", "a", "b", "c"]


def test_replica_larger_than_any_node_gets_no_target():
    nodes = [NodeCapacity("a", 2), NodeCapacity("b", 2)]
    assert spread_replicas(1, RankResources(cpus=1), 4, nodes) == [None]


def test_shortfall_names_what_is_missing():
    mesh = MeshSpec(dp_shard=2, tp=4)
    assert shortfall(mesh, RankResources(cpus=1), [NodeCapacity("a", 16)]) is None
    text = shortfall(mesh, RankResources(cpus=4), [NodeCapacity("a", 16)])
    assert text == "8 ranks need 32 CPUs and 0 GPUs; the cluster has 16 CPUs and 0 GPUs"
    split = shortfall(mesh, RankResources(cpus=1, gpus=1), [NodeCapacity("a", 8, 2), NodeCapacity("b", 8, 6)])
    assert split == (
        "a tensor-parallel group of tp=4 ranks needs 4 CPUs and 4 GPUs on one node; "
        "the nodes can hold only 1 of the 2 groups"
    )
