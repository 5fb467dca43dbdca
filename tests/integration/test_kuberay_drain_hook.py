"""The worker pods' preStop hook (deploy/kuberay/base/hooks/drain_node.py) against real Ray nodes.

    python -m pytest tests/integration/test_kuberay_drain_hook.py -q

Worker nodes are added to the session's Ray cluster (tests/fixtures/ray_cluster.py) and removed
again; an actor stands in for a rank on the worker. The hook runs as its own process, as it does in a terminating pod,
and must (1) mark the node draining in the GCS with reason PREEMPTION and its deadline, (2) keep
the pod alive while the rank is there, (3) return as soon as the rank has left and the raylet
is gone, and (4) give up at the deadline when nobody reacts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.core.generated import common_pb2, gcs_pb2

HOOK = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "base" / "hooks" / "drain_node.py"


@pytest.fixture
def cluster(ray_cluster):
    """The session cluster; the worker nodes a test adds are removed when it ends."""
    known = set(ray_cluster.worker_nodes)
    yield ray_cluster
    for node in [node for node in ray_cluster.worker_nodes if node not in known]:
        ray_cluster.remove_node(node, allow_graceful=False)


class Rank:
    @ray.method  # no options: types node() as an actor method, with .remote()
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


# ray.remote applied as a call, not as a class decorator: mypy keeps a decorated class's own type, so it would
# not see the ActorClass that ray.remote returns (and its .remote()).
RemoteRank = ray.remote(num_cpus=1, resources={"spot": 1})(Rank)


def _worker_with_rank(cluster) -> tuple[str, object]:
    node = cluster.add_node(num_cpus=1, resources={"spot": 1})
    rank = RemoteRank.remote()
    assert ray.get(rank.node.remote()) == node.node_id
    return node.node_id, rank


def _start_hook(cluster, node_id: str, *, grace: float, margin: float) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": cluster.address}  # KubeRay sets RAY_ADDRESS in each Ray container
    return subprocess.Popen(
        [
            sys.executable,
            str(HOOK),
            "--grace-seconds",
            str(grace),
            "--margin-seconds",
            str(margin),
            "--node-id",
            node_id,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _gcs():
    return ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)


def _wait_draining(node_id: str, hook: subprocess.Popen, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        draining = _gcs().get_draining_nodes()
        if node_id in draining:
            return draining[node_id]
        assert hook.poll() is None, hook.communicate()
        time.sleep(0.2)
    raise AssertionError(f"node {node_id} never showed up as draining")


def _node_info(node_id: str):
    return _gcs().get_all_node_info()[ray.NodeID.from_hex(node_id)]


def test_hook_drains_and_returns_once_the_rank_has_left(cluster):
    node_id, rank = _worker_with_rank(cluster)
    hook = _start_hook(cluster, node_id, grace=60, margin=10)
    started = time.time()
    deadline_ms = _wait_draining(node_id, hook)
    assert abs(deadline_ms / 1000 - (started + 50)) < 10  # now + grace - margin
    time.sleep(1.0)
    assert hook.poll() is None, "the hook must hold the pod while a rank is still on the node"
    assert ray.get(rank.node.remote()) == node_id  # the running rank is untouched by the drain

    ray.kill(rank)  # the driver ends the drained node's ranks at a step boundary
    left_at = time.monotonic()
    _, stderr = hook.communicate(timeout=30)
    assert hook.returncode == 0
    assert time.monotonic() - left_at < 10
    info = _node_info(node_id)
    assert info.state == gcs_pb2.GcsNodeInfo.DEAD
    assert info.death_info.reason == common_pb2.NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED
    assert info.death_info.reason_message.startswith("pod ") and info.death_info.reason_message.endswith(" terminating")
    assert f"node {node_id} draining" in stderr and f"node {node_id} has left the cluster" in stderr


def test_hook_gives_up_at_the_deadline(cluster):
    node_id, rank = _worker_with_rank(cluster)
    hook = _start_hook(cluster, node_id, grace=6, margin=2)
    started = time.monotonic()
    _wait_draining(node_id, hook)
    _, stderr = hook.communicate(timeout=30)
    assert hook.returncode == 0
    assert 3.0 < time.monotonic() - started < 10
    assert "deadline reached" in stderr
    assert _node_info(node_id).state == gcs_pb2.GcsNodeInfo.ALIVE  # nobody left: SIGTERM's turn
    ray.kill(rank)


def test_hook_does_not_guess_between_nodes_of_one_host(cluster):
    cluster.add_node(num_cpus=1)  # here every node has this machine's hostname; in a pod only one does
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    draining_before = set(_gcs().get_draining_nodes())
    result = subprocess.run(
        [sys.executable, str(HOOK), "--grace-seconds", "20"], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0
    assert "ALIVE Ray node(s) match this pod" in result.stderr and "pass --node-id; not draining" in result.stderr
    assert set(_gcs().get_draining_nodes()) <= draining_before


def test_hook_without_a_gcs_returns_within_its_budget():
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            str(HOOK),
            "--grace-seconds",
            "4",
            "--margin-seconds",
            "1",
            "--address",
            "127.0.0.1:1",
            "--node-id",
            "ab" * 28,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0
    assert time.monotonic() - started < 8
    assert "deadline reached" in result.stderr
