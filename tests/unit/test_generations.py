"""A rank that leaves one generation and joins the next holds nothing of the old one.

Single process, world size 1, real gloo: what a surviving rank does between generations
(workers/actor.py: destroy the world, init_generation, forget_old_meshes, build the mesh).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from elastic.spec import MeshSpec
from workers.parallelize import build_world_mesh, data_parallel_mesh, forget_old_meshes
from workers.runtime import init_generation


@pytest.fixture
def store():
    yield dist.HashStore()
    if dist.is_initialized():
        dist.destroy_process_group()


def join(store, generation: int):
    """What configure() does on a rank: the generation's groups, fresh caches, the mesh."""
    if dist.is_initialized():
        dist.destroy_process_group()
    init_generation(store=store, generation=generation, rank=0, world_size=1, backend="gloo", timeout_s=30)
    forget_old_meshes()
    world = build_world_mesh(MeshSpec(), "cpu")
    return world, data_parallel_mesh(world, MeshSpec())


def gradient_like_op(dp_mesh):
    partial = DTensor.from_local(torch.full((4,), 2.0), dp_mesh, [Partial()])
    return partial * 3


def test_dtensor_ops_of_a_new_generation_run_on_its_mesh(store):
    _, old_dp = join(store, 0)
    assert gradient_like_op(old_dp).device_mesh is old_dp
    _, new_dp = join(store, 1)
    # The old mesh compares equal to the new one (same layout); a cache that kept it would
    # send the new generation's collectives to the old generation's (destroyed) groups.
    assert new_dp == old_dp
    result = gradient_like_op(new_dp)
    assert result.device_mesh is new_dp
    assert torch.equal(result.full_tensor(), torch.full((4,), 6.0))


def test_each_generation_names_its_process_groups_afresh(store):
    old_world, _ = join(store, 0)
    old_names = set(old_world._dim_group_names) | {dist.group.WORLD.group_name}
    new_world, _ = join(store, 1)
    new_names = set(new_world._dim_group_names) | {dist.group.WORLD.group_name}
    assert old_names.isdisjoint(new_names)
    with pytest.raises(RuntimeError, match="Could not resolve the process group"):
        torch.ops._c10d_functional.all_reduce(torch.ones(1), "sum", sorted(old_names)[0])
