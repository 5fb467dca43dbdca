"""The bearer token of a token-protected Ray cluster (on by default since Ray 2.52 clusters).

Runs on the user's machine. The token is read the way Ray reads it (``RAY_AUTH_TOKEN``, the
file named by ``RAY_AUTH_TOKEN_PATH``, or ``~/.ray/auth_token``) and sent as a bearer header,
unless ``RAY_AUTH_MODE=disabled``. It is never printed: every value is registered with
orchestrator.observe.redact, and every message names where a token is looked for, never its value.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.observe.redact import register_secret


def auth_headers() -> dict[str, str]:
    """The bearer header for a token-protected cluster, looked up the way Ray looks it up.

    Nothing is sent with ``RAY_AUTH_MODE=disabled`` or when no token exists (the cluster then
    says whether it wanted one).
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return {}
    token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token_path and not os.environ.get("RAY_AUTH_TOKEN"):
        path = Path(token_path).expanduser()
        if not path.is_file() or not path.read_text(encoding="utf-8", errors="replace").strip():
            raise UserError(
                f"RAY_AUTH_TOKEN_PATH={token_path} is not a readable, non-empty file; point it at "
                "the cluster's token file (the head's ~/.ray/auth_token)"
            )
    from orchestrator.driver import ray_compat  # the loader Ray's own clients use, behind the fence

    headers = ray_compat.auth_token_header()
    for value in headers.values():
        register_secret(value)
        register_secret(value.split(" ", 1)[-1])
    return headers


def auth_message(text: str, address: str, *, sent_token: bool) -> str:
    """One line for the user when the cluster refused us: no token found, or the wrong one."""
    if "required" in text.lower() or not sent_token:
        return (
            f"the Ray cluster at {address} requires a token (token authentication is on) and none was "
            "found: copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
        )
    return (
        f"the Ray cluster at {address} rejected the token (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
        "~/.ray/auth_token): use the token the cluster was started with"
    )
