"""The driver's fence around Ray's private APIs: the only driver module that touches them.

Runs on the driver (and in ``meshpilot submit`` / ``jobs`` on the user's machine). Importing it
checks that every private symbol below exists in the installed Ray, and the rank side's ones
too (it imports ``workers/ray_compat.py``, where the check and the supported version live); a
Ray that moved one is refused at once with one line naming the Ray meshpilot supports and the
one found, as a UserError (exit 2, no traceback). Public Ray APIs are used directly elsewhere.
"""

from __future__ import annotations

import logging
import os
from enum import Enum
from typing import Any

from ray.util.placement_group import PlacementGroup, placement_group

from orchestrator.errors import UserError

try:
    from workers import ray_compat as rank_compat
except RuntimeError as error:
    if type(error).__name__ != "UnsupportedRay":  # the class itself is defined by the import that failed
        raise
    raise UserError(str(error)) from None

# Ray logs a notice when it sets token authentication up; this is that logger's name.
TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"

REQUIRED: tuple[str, ...] = (
    "ray._private.state.available_resources_per_node",
    "ray._private.state.state.get_draining_nodes",
    "ray._private.state.actors",
    "ray._raylet.AuthenticationTokenLoader.instance",
    "ray._raylet.AuthenticationTokenLoader.has_token",
    "ray._raylet.AuthenticationTokenLoader.get_token_for_http_header",
    "ray._private.authentication.authentication_token_setup.maybe_enable_token_auth_if_token_available",
    "ray._private.authentication.authentication_token_setup.AUTH_MODE_ENV_VAR",
    "ray.util.placement_group.placement_group(_soft_target_node_id)",
    "ray._private.services.canonicalize_bootstrap_address",
    "ray._private.grpc_utils.init_grpc_channel",
    "ray.core.generated.gcs_service_pb2.GetClusterIdRequest",
    "ray.core.generated.gcs_service_pb2_grpc.NodeInfoGcsServiceStub",
    TOKEN_SETUP_LOGGER,
)

try:
    rank_compat.require(REQUIRED)
except rank_compat.UnsupportedRay as error:
    raise UserError(str(error)) from None


def silence_token_setup_notice() -> None:
    """Token authentication stays on (Ray 2.60's default); its start-up notice is not ours to print."""
    logging.getLogger(TOKEN_SETUP_LOGGER).setLevel(logging.ERROR)


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Node id -> the resources not yet reserved on it, now (Ray's state API, connected driver)."""
    from ray._private import state

    return state.available_resources_per_node()


def draining_node_ids() -> set[str]:
    """Nodes Ray has been told are going away (preemption, autoscaler, ``ray drain-node``)."""
    from ray._private import state

    return set(state.state.get_draining_nodes())


def live_actors() -> list[tuple[str, str]]:
    """(class name, actor id) of every actor of the cluster not dead, read from the GCS (the
    public state API needs the dashboard, which an embedded or test cluster may not run)."""
    from ray._private import state

    return [(info["ActorClassName"], info["ActorID"]) for info in state.actors().values() if info["State"] != "DEAD"]


class ClusterAuth(Enum):
    """What a Ray cluster's GCS does with a call that carries no token."""

    TOKEN = "token"  # refuses it: the cluster runs in token mode
    NONE = "none"  # answers it: the cluster runs without token authentication
    UNKNOWN = "unknown"  # no answer: unreachable, not a GCS, or a ray:// (Ray Client) address


def cluster_auth(address: str, timeout_s: float = 5.0) -> ClusterAuth:
    """Ask the GCS at ``address`` (``host:port`` or ``auto``) for its cluster id without a token:
    one call, before ``ray.init`` (which, refused, retries for 20 s)."""
    import grpc
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.services import canonicalize_bootstrap_address
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    if address.startswith("ray://"):
        return ClusterAuth.UNKNOWN
    try:
        gcs_address = canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - ray.init reports a bad address in its own words
        return ClusterAuth.UNKNOWN
    if gcs_address is None:
        return ClusterAuth.UNKNOWN
    # This process is not in token mode yet (RAY_AUTH_MODE unset), so the channel sends no token.
    channel = init_grpc_channel(gcs_address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        # Generated protobuf classes carry no type stubs; the request exists (checked at import).
        request = gcs_service_pb2.GetClusterIdRequest()  # type: ignore[attr-defined]
        stub.GetClusterId(request, timeout=timeout_s)
    except grpc.RpcError as error:
        return ClusterAuth.TOKEN if error.code() == grpc.StatusCode.UNAUTHENTICATED else ClusterAuth.UNKNOWN
    finally:
        channel.close()
    return ClusterAuth.NONE


def use_token_if_available(address: str) -> bool:
    """Before connecting to the cluster at ``address``: with ``RAY_AUTH_MODE`` unset and a token
    found the way Ray's clients find it (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``), turn token authentication on for this process and those it starts,
    unless the cluster runs without it. Ray does so by itself only for a cluster it starts; a
    token-protected cluster (its default) refuses a driver without one. True when token
    authentication is on.

    Why not whenever a token exists (any embedded ``ray.init`` writes ~/.ray/auth_token): a
    driver in token mode refuses the calls of a cluster without it, and that cluster's GCS (Ray 2.60) takes
    the refused poll of an actor's owner for the owner's death, so every actor the driver owns
    (not detached) is destroyed before it starts ("all references to the actor were removed").
    Such a cluster is joined with ``RAY_AUTH_MODE=disabled`` set for this process, which also
    keeps ``ray.init(address="auto")`` from turning token mode on by itself."""
    from ray._private.authentication.authentication_token_setup import (
        AUTH_MODE_ENV_VAR,
        maybe_enable_token_auth_if_token_available,
    )

    if os.environ.get(AUTH_MODE_ENV_VAR) is None and cluster_auth(address) is ClusterAuth.NONE:
        os.environ[AUTH_MODE_ENV_VAR] = "disabled"
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def auth_token_header() -> dict[str, str]:
    """The HTTP header carrying the cluster's auth token, found the way Ray's own clients find it;
    {} when there is none. The caller registers the value for redaction."""
    # Ray's _raylet.pyi stub lists only part of the compiled module; the class exists at run time.
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    loader = AuthenticationTokenLoader.instance()
    if not loader.has_token(ignore_auth_mode=True):
        return {}
    return dict(loader.get_token_for_http_header(ignore_auth_mode=True))


def placement_group_on(
    node_id: str, bundles: list[dict[str, Any]], *, strategy: str, name: str, lifetime: str | None = None
) -> PlacementGroup:
    """A placement group that Ray places on ``node_id`` when it can, elsewhere when it cannot
    (``lifetime="detached"``: it outlives the driver)."""
    return placement_group(bundles, strategy=strategy, name=name, lifetime=lifetime, _soft_target_node_id=node_id)
