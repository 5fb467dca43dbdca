"""Connecting the driver to Ray: an embedded local cluster, or an existing one.

Runs on the driver. ``RAY_ADDRESS`` is read here, at the edge, and nowhere else.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from elastic.placement import NodeCapacity, RankResources, usable
from orchestrator.config import JobConfig
from orchestrator.driver import ray_compat
from orchestrator.errors import ConfigError, UserError

log = logging.getLogger("meshpilot")

# The directory holding orchestrator/, workers/, checkpointing/, elastic/: Ray workers of an
# embedded cluster import exactly the code the driver runs, installed or not.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
WORKER_PACKAGES = ("workers", "checkpointing", "elastic")


def connect(config: JobConfig) -> bool:
    """Connect to Ray; returns True when this call started an embedded cluster (to shut down).

    With ``runtime.survive_driver_loss`` the driver joins the run's Ray namespace, where its
    detached actors are named (``adoption.run_namespace``), and an embedded cluster is refused:
    it dies with the driver, and the actors with it."""
    namespace = None
    if config.runtime.survive_driver_loss:
        from orchestrator.driver.adoption import run_namespace

        if not ray.is_initialized() and not (config.runtime.address or os.environ.get("RAY_ADDRESS")):
            raise ConfigError(
                "runtime.survive_driver_loss=true needs a Ray cluster that outlives the driver, and the "
                "embedded one `meshpilot train` starts without an address dies with it: start Ray with "
                "`ray start --head` and set RAY_ADDRESS (or --address), or set runtime.survive_driver_loss=false"
            )
        namespace = run_namespace(config)
    return connect_to(config.runtime.address, num_cpus=embedded_cpus(config), namespace=namespace)


def connect_to(
    address: str | None, *, num_cpus: int, packages: tuple[str, ...] = WORKER_PACKAGES, namespace: str | None = None
) -> bool:
    """Connect to the cluster at ``address`` (else ``RAY_ADDRESS``, else a new embedded one of ``num_cpus``).

    Returns True when this call started an embedded cluster (the caller shuts it down). ``packages``
    are the source directories a remote cluster's workers import (shipped unless its image has them).
    ``namespace``: the Ray namespace to join (None: an anonymous one).
    """
    ray_compat.silence_token_setup_notice()
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray_compat.use_token_if_available(address)
            ray.init(
                address=address,
                namespace=namespace,
                runtime_env=_remote_runtime_env(address, packages),
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            return False
        # Workers of an embedded cluster inherit the driver's environment; a runtime_env
        # would instead give every actor a fresh worker and waste the pre-started ones.
        os.environ["PYTHONPATH"] = worker_pythonpath()
        # address="local": always a new embedded cluster, never one a `ray start` left on this machine.
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except ConnectionError as error:
        raise UserError(
            f"cannot reach the Ray cluster at {address!r}: {error}. Check runtime.address / "
            "--address / RAY_ADDRESS, and for a token-protected cluster (Ray's default) its head's "
            "token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; or leave them unset "
            "for an embedded local cluster"
        ) from None
    return True


def embedded_cpus(config: JobConfig) -> int:
    """The logical CPUs of the embedded cluster ``config`` gets (bench/overhead.py starts its
    running cluster with as many)."""
    if config.runtime.num_cpus is not None:
        return config.runtime.num_cpus
    needed = config.mesh.world_size * config.runtime.cpus_per_rank
    # Logical CPUs, not cores: more than the machine has is fine (FACTS.md: otherwise the
    # fourth 1-CPU actor on a 2-core machine never schedules). At least one per rank and one
    # for the store: Ray pre-starts that many worker processes, and the actors take them.
    return max(os.cpu_count() or 1, math.ceil(needed), config.mesh.world_size + 1)


def worker_pythonpath() -> str:
    existing = os.environ.get("PYTHONPATH")
    return f"{SOURCE_ROOT}{os.pathsep}{existing}" if existing else str(SOURCE_ROOT)


def _remote_runtime_env(address: str, packages: tuple[str, ...]) -> dict:
    """Ship the worker-side packages unless the cluster's image has them (a Ray job already does)."""
    if os.environ.get("RAY_JOB_ID") or address == "auto":
        return {}
    return {"py_modules": [str(SOURCE_ROOT / name) for name in packages]}


def alive_nodes() -> list[NodeCapacity]:
    """Schedulable nodes with their total CPU and GPU resources."""
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        nodes.append(_capacity(node["NodeID"], node.get("Resources", {})))
    return nodes


def _capacity(node_id: str, resources: dict) -> NodeCapacity:
    custom = {
        name: float(amount)
        for name, amount in resources.items()
        if name not in ("CPU", "GPU", "memory", "object_store_memory") and not name.startswith("node:")
    }
    return NodeCapacity(
        node_id=node_id, cpus=float(resources.get("CPU", 0.0)), gpus=float(resources.get("GPU", 0.0)), custom=custom
    )


def hosts_for(per_rank: RankResources) -> set[str]:
    """Alive nodes (draining or not) that could hold a rank: big enough, with its custom resources."""
    return {
        node.node_id
        for node in usable(alive_nodes(), per_rank)
        if node.cpus >= per_rank.cpus and node.gpus >= per_rank.gpus
    }


def driver_node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def free_nodes() -> list[NodeCapacity]:
    """Alive nodes that are not draining, with the CPUs and GPUs not yet reserved, now."""
    alive = {node.node_id for node in alive_nodes()} - draining_nodes()
    free = []
    for node_id, resources in ray_compat.available_resources_per_node().items():
        if node_id in alive:
            free.append(_capacity(node_id, resources))
    return free


def draining_nodes() -> set[str]:
    """Nodes Ray has been told are going away (preemption, autoscaler, ``ray drain-node``)."""
    return ray_compat.draining_node_ids()


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Those of ``node_ids`` that Ray no longer sees alive."""
    alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
    return {node_id for node_id in node_ids if node_id not in alive}


# How long a node's raylet may take to accept a TCP connection before the node counts as unreachable:
# its kernel answers at once however loaded the machine is, unless the network between is gone.
REACH_TIMEOUT_S = 0.5


def unreachable_nodes(node_ids: set[str], timeout_s: float = REACH_TIMEOUT_S) -> set[str]:
    """Those of ``node_ids`` that Ray reports dead or whose raylet accepts no TCP connection
    within ``timeout_s`` (a partitioned node: Ray's own health checks take many seconds)."""
    if not node_ids:
        return set()
    addresses = {
        node["NodeID"]: (node["NodeManagerAddress"], node["NodeManagerPort"])
        for node in ray.nodes()
        if node["NodeID"] in node_ids and node.get("Alive")
    }
    with ThreadPoolExecutor(max_workers=len(addresses) or 1) as pool:
        answers = dict(zip(addresses, pool.map(lambda address: _answers(address, timeout_s), addresses.values())))
    return {node_id for node_id in node_ids if not answers.get(node_id, False)}


def _answers(address: tuple[str, int], timeout_s: float) -> bool:
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True
