"""Joining a Ray cluster by its address turns token mode on only where the cluster wants it.

A driver in token mode refuses every call that carries no token, and a cluster without token mode
sends none: its GCS then takes the refused "is this actor still referenced?" poll for the driver's
death and destroys every actor the driver owns before it starts. Any embedded ``meshpilot train``
leaves a token in ~/.ray/auth_token, so a token on the driver's machine says nothing about the
cluster; the driver asks the cluster's GCS instead. Fake GCS servers here answer as Ray 2.60's
does (``UNAUTHENTICATED`` in token mode); tests/integration/test_train_cli.py joins a real one.

python -m pytest tests/unit/test_cluster_auth.py -q
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import ray
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from orchestrator.driver.ray_compat import ClusterAuth, cluster_auth, use_token_if_available


class _FakeGcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
    def __init__(self, token_mode: bool) -> None:
        self.token_mode = token_mode

    def GetClusterId(self, request, context):
        if self.token_mode and "authorization" not in dict(context.invocation_metadata()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing")
        return gcs_service_pb2.GetClusterIdReply(cluster_id=b"c" * 28)


@pytest.fixture
def fake_gcs() -> Iterator:
    """Start a fake GCS (token mode or not); yields a function returning its address."""
    servers = []

    def start(*, token_mode: bool) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(_FakeGcs(token_mode), server)
        # Ray resolves a loopback address to the node's own; listen where it will call.
        host = ray.util.get_node_ip_address()
        port = server.add_insecure_port(f"{host}:0")
        server.start()
        servers.append(server)
        return f"{host}:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


@pytest.fixture
def unset_auth_mode(monkeypatch):
    """A user's shell: RAY_AUTH_MODE unset (and restored after, whatever the test sets)."""
    monkeypatch.setenv("RAY_AUTH_MODE", "restored-after-the-test")
    monkeypatch.delenv("RAY_AUTH_MODE")


def test_a_cluster_in_token_mode_refuses_a_call_without_a_token(fake_gcs):
    assert cluster_auth(fake_gcs(token_mode=True)) is ClusterAuth.TOKEN


def test_a_cluster_without_token_mode_answers_without_one(fake_gcs):
    assert cluster_auth(fake_gcs(token_mode=False)) is ClusterAuth.NONE


def test_no_answer_leaves_the_question_open():
    host = ray.util.get_node_ip_address()
    with socket.socket() as bound:
        bound.bind((host, 0))  # bound, not listening: the call is refused
        assert cluster_auth(f"{host}:{bound.getsockname()[1]}") is ClusterAuth.UNKNOWN
    assert cluster_auth("ray://head:10001") is ClusterAuth.UNKNOWN  # Ray Client: not a GCS


def test_a_driver_with_a_token_joins_a_cluster_without_token_mode_with_it_off(fake_gcs, unset_auth_mode, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "f" * 32)  # as ~/.ray/auth_token after any embedded run
    assert use_token_if_available(fake_gcs(token_mode=False)) is False
    # Explicit, so ray.init does not turn it on by itself either (it does for address="auto").
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
