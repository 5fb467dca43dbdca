"""The private torch symbols meshpilot uses are checked in one place, with one clear error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from checkpointing import torch_compat


def test_every_private_symbol_exists_in_the_installed_torch():
    torch_compat.check_torch_internals()


def test_a_missing_symbol_names_the_supported_torch_and_the_one_found(monkeypatch):
    monkeypatch.delattr(c10d, "_abort_process_group")
    with pytest.raises(torch_compat.TorchVersionError) as raised:
        torch_compat.check_torch_internals()
    message = str(raised.value)
    assert "\n" not in message
    assert "supports torch 2.13.x" in message and f"found torch {torch.__version__}" in message
    assert "torch.distributed.distributed_c10d._abort_process_group" in message


def test_a_missing_nested_attribute_is_named_too(monkeypatch):
    monkeypatch.setattr(c10d, "_world", object())
    with pytest.raises(torch_compat.TorchVersionError, match=r"_world\.group_count"):
        torch_compat.check_torch_internals()


def test_no_other_module_names_a_private_torch_symbol():
    """The fence holds: the private names appear in torch_compat.py only."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    private = (
        "_world.group_count",
        "_abort_process_group",
        "_create_chunk_list",
        "_op_dispatcher",
        "_clear_DTensor_sharding_propagator_cache",
        "clear_redistribute_planner_cache",
        "MeshTopoInfo",
        "compute_local_shape_and_global_offset",
        "tensor._redistribute",
    )
    offenders = []
    for folder in ("workers", "checkpointing", "orchestrator", "elastic"):
        for path in (repo / folder).rglob("*.py"):
            if path.name == "torch_compat.py":
                continue
            text = path.read_text(encoding="utf-8")
            offenders += [f"{path.relative_to(repo)}: {name}" for name in private if name in text]
    assert offenders == []


def test_local_tensor_shape_is_the_shape_to_local_gives():
    """A fake process group makes this process rank 1 of 4: its slice of 10 rows is rows 3-5."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (4,))
        tensor = DTensor.from_local(
            torch.zeros(3, 2), mesh, [Shard(0)], run_check=False, shape=torch.Size((10, 2)), stride=(2, 1)
        )
        assert torch_compat.local_tensor_shape(tensor) == tuple(tensor.to_local().shape) == (3, 2)
    finally:
        dist.destroy_process_group()
