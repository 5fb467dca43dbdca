"""The rank side's fence around Ray's private APIs, and the check every fence runs at import.

Runs in a rank's process (the drain fault) and, through ``orchestrator/driver/ray_compat.py``,
on the driver. Every private Ray symbol meshpilot uses is reached through this module or the
driver's fence, nowhere else, and each fence checks at import that the symbols it needs exist:
a Ray that moved one fails at once with one line naming the Ray meshpilot supports and the Ray
found, not deep inside a run with an AttributeError.

Why two fences and not one: ``workers/`` never imports ``orchestrator/``, so the rank side
cannot use the driver's fence; the driver may import ``workers``, so the shared check lives
here. The driver's fence imports this module, which makes every rank-side symbol checked at
driver start too (driver and ranks run one Ray version; Ray refuses a mismatched cluster), long
before a rank needs one. ``ray`` itself is imported here, so import this module only where Ray
is needed (``workers/faults.py`` does so inside the drain fault, keeping the CLI's start fast).
"""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Iterable
from typing import Any

import ray

# The Ray minor version these private symbols are checked against (pyproject.toml pins ray>=2.60,<2.61).
SUPPORTED_RAY = "2.60"

# What the drain fault needs: the connected worker's GCS client and the preemption reason.
REQUIRED: tuple[str, ...] = (
    "ray._private.worker.global_worker",
    "ray._raylet.InnerGcsClient.drain_node",
    "ray.core.generated.autoscaler_pb2.DrainNodeReason",
)


class UnsupportedRay(RuntimeError):
    """The installed Ray lacks a private symbol meshpilot uses; the message names both versions."""


def missing_symbols(required: Iterable[str]) -> list[str]:
    """Those of ``required`` this Ray lacks.

    Each entry is a dotted path (``ray._private.state.available_resources_per_node``) or a
    callable's keyword (``ray.util.placement_group.placement_group(_soft_target_node_id)``).
    """
    return [name for name in required if not _exists(name)]


def require(required: Iterable[str]) -> None:
    """Raise UnsupportedRay (one line) when this Ray lacks any of ``required``."""
    missing = missing_symbols(required)
    if missing:
        raise UnsupportedRay(unsupported_message(missing))


def unsupported_message(missing: list[str]) -> str:
    return (
        f"meshpilot supports Ray {SUPPORTED_RAY}.x, but Ray {ray.__version__} is installed and lacks "
        f"{', '.join(missing)}: install ray=={SUPPORTED_RAY}.* (as pyproject.toml pins it)"
    )


def _exists(name: str) -> bool:
    path, _, keyword = name.partition("(")
    target = _resolve(path)
    if target is None or not keyword:
        return target is not None
    try:
        return keyword.rstrip(")") in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def _resolve(path: str) -> Any | None:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute, None)
            if target is None:
                return None
        return target
    return None


require(REQUIRED)


# --------------------------------------------------------------------- rank side
def drain_node_for_preemption(node_id: str, message: str, *, deadline_s: float = 60.0) -> None:
    """Tell Ray's GCS that ``node_id`` will be preempted, as the autoscaler or a preStop hook does.

    Runs in a connected Ray process (a rank firing the ``drain`` fault).
    """
    from ray._private import worker
    from ray.core.generated import autoscaler_pb2

    deadline_ms = int((time.time() + deadline_s) * 1000)
    # Neither name is visible to a type checker: protobuf builds the enum from a descriptor at
    # import, and Ray sets the GCS client on the worker when it connects.
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
    worker.global_worker.gcs_client.drain_node(node_id, reason, message, deadline_ms)  # type: ignore[attr-defined]
