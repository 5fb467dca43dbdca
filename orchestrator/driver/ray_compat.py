"""The driver's fence around Ray's private APIs: the only driver module that touches them.

Runs on the driver (and in ``meshpilot submit`` / ``jobs`` on the user's machine). Importing it
checks that every private symbol below exists in the installed Ray, and the rank side's ones
too (it imports ``workers/ray_compat.py``, where the check and the supported version live); a
Ray that moved one is refused at once with one line naming the Ray meshpilot supports and the
one found, as a UserError (exit 2, no traceback). Public Ray APIs are used directly elsewhere.
"""

from __future__ import annotations

import logging
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
    "ray.util.placement_group.placement_group(_soft_target_node_id)",
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


def use_token_if_available() -> bool:
    """Before connecting to a cluster by its address: with ``RAY_AUTH_MODE`` unset and a token
    found the way Ray's clients find it (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``,
    ``~/.ray/auth_token``), turn token authentication on for this process and those it starts.
    Ray does so by itself only for a cluster it starts; a token-protected cluster (its default)
    refuses a driver without one. True when token authentication is on."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

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
