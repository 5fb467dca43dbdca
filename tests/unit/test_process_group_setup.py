"""What a rank sets up before joining a generation, per backend: environment, init arguments, sockets.

    python -m pytest tests/unit/test_process_group_setup.py -q

NCCL cannot run here; its set-up is checked where it is decided (pure functions, and the
arguments ``init_generation`` hands to ``init_process_group``), gloo's for real.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from workers import runtime
from workers.device import RankDevice
from workers.runtime import NCCL_ENVIRONMENT, process_group_environment, process_group_options
from workers.sockets import GroupSockets

NCCL_VALUES = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
EVERY_NAME = [name for names, _ in NCCL_ENVIRONMENT for name in names]


def test_nccl_gets_the_driver_owned_timeouts_and_the_flight_recorder():
    assert process_group_environment("nccl", {}) == NCCL_VALUES


def test_gloo_sets_nothing():
    assert process_group_environment("gloo", {}) == {}


def test_a_value_the_user_set_is_never_overridden():
    chosen = process_group_environment("nccl", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_NVLS_ENABLE": "1"})
    assert chosen == {
        k: v for k, v in NCCL_VALUES.items() if k not in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_NVLS_ENABLE")
    }
    # torch reads the older names too: a user's NCCL_ASYNC_ERROR_HANDLING is their choice as well.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in process_group_environment(
        "nccl", {"NCCL_ASYNC_ERROR_HANDLING": "1"}
    )
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in process_group_environment("nccl", {"TORCH_FR_BUFFER_SIZE": "0"})


def test_nccl_groups_are_bound_to_the_rank_gpu_and_gloo_groups_are_not():
    assert process_group_options("nccl", RankDevice(torch.device("cuda", 0))) == {"device_id": torch.device("cuda", 0)}
    assert process_group_options("gloo", RankDevice(torch.device("cpu"))) == {}


@pytest.fixture
def clean_nccl_environment(monkeypatch):
    for name in EVERY_NAME:
        monkeypatch.delenv(name, raising=False)  # restored (removed again) after the test
    return monkeypatch


def test_an_nccl_generation_sets_the_environment_before_its_process_group(clean_nccl_environment):
    clean_nccl_environment.setenv("NCCL_NVLS_ENABLE", "1")  # the user's choice
    seen: dict[str, Any] = {}

    def fake_init_process_group(backend: str, **kwargs: Any) -> None:
        seen["environment"] = {name: os.environ.get(name) for name in NCCL_VALUES}
        seen["device_id"] = kwargs.get("device_id")

    clean_nccl_environment.setattr(runtime.dist, "init_process_group", fake_init_process_group)
    runtime.init_generation(
        store=dist.HashStore(),
        generation=0,
        rank=0,
        world_size=1,
        backend="nccl",
        timeout_s=30,
        device=RankDevice(torch.device("cuda", 0)),
    )
    assert seen["environment"] == {**NCCL_VALUES, "NCCL_NVLS_ENABLE": "1"}
    assert seen["device_id"] == torch.device("cuda", 0)


def test_a_gloo_generation_leaves_the_environment_alone(clean_nccl_environment):
    before = dict(os.environ)
    runtime.init_generation(store=dist.HashStore(), generation=0, rank=0, world_size=1, backend="gloo", timeout_s=30)
    try:
        assert dict(os.environ) == before
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="sockets are found through /proc")
@pytest.mark.parametrize(("backend", "shut_down_on_leave"), [("gloo", True), ("nccl", False)])
def test_only_gloo_groups_have_their_sockets_shut_down(backend: str, shut_down_on_leave: bool):
    watch = GroupSockets(backend)
    left, right = socket.socketpair()  # stands for the connections a process group opens
    try:
        assert len(watch.opened()) == (2 if shut_down_on_leave else 0)
    finally:
        left.close()
        right.close()
