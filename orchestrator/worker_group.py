"""The job's rank actors and where they run: placement groups, the store host, fan-out calls.

Runs on the driver. One placement group per replica group (bundles = whole tensor-parallel
groups, strategy STRICT_PACK on a soft target node chosen to spread replicas over nodes, or
PACK when a replica group is larger than any node), one actor per
rank, and one ``StoreHost`` actor on the driver's node. Every method that talks to all ranks
returns Ray object refs; the controller decides how long to wait for them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from elastic.placement import RankResources, shortfall, spread_replicas, tp_bundles
from elastic.spec import MeshSpec
from orchestrator import cluster
from orchestrator.errors import ConfigError
from workers.actor import RankActor, StartFrom
from workers.rendezvous import StoreHost
from workers.spec import TrainSpec

log = logging.getLogger("meshpilot")

# Threads per rank actor: the loop, plus control calls (poll, stop) answered while it runs.
ACTOR_CONCURRENCY = 4


@dataclass(frozen=True)
class CallFailed:
    """A remote call that did not return: the actor died (``died``) or raised (``error``)."""

    kind: str
    message: str


class PendingCalls:
    """One method called on many ranks (driver side); results are collected as they arrive.

    Results are the method's return values, or ``CallFailed`` for an actor that died or
    raised: the controller never handles a Ray exception itself.
    """

    def __init__(self, refs: list[Any]) -> None:
        self.refs = list(refs)
        self.results: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.refs)

    def collect(self, timeout: float) -> dict[int, Any]:
        """Wait up to ``timeout`` seconds; returns the results that arrived in this call."""
        waiting = [ref for index, ref in enumerate(self.refs) if index not in self.results]
        if not waiting:
            return {}
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout)
        arrived = {}
        for ref in ready:
            index = self.refs.index(ref)
            arrived[index] = self.results[index] = _result_of(ref)
        return arrived


def _result_of(ref: Any) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as error:
        return CallFailed("died", _first_line(error))
    except ray.exceptions.RayError as error:
        return CallFailed("error", _first_line(error))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@dataclass
class RankSlot:
    """A live rank actor and where it sits."""

    actor: Any
    replica: int
    placement_group: PlacementGroup
    node_id: str | None = None


class WorkerGroup:
    """All rank actors of one job (driver side)."""

    def __init__(self, *, spec: TrainSpec, data: bytes | None, per_rank: RankResources,
                 start_timeout_s: float) -> None:
        self.spec = spec
        self.per_rank = per_rank
        self.start_timeout_s = start_timeout_s
        self.data_ref = ray.put(data)
        self.slots: list[RankSlot] = []
        self.store_host = None
        self.store_address: tuple[str, int] | None = None

    # ------------------------------------------------------------------ start
    def start(self, mesh: MeshSpec) -> None:
        """Place and start one actor per rank of ``mesh``; raise ConfigError if it cannot fit."""
        nodes = cluster.alive_nodes()
        problem = shortfall(mesh, self.per_rank, nodes)
        if problem:
            raise ConfigError(f"parallelism: {mesh.describe()} cannot be placed: {problem}; lower the degrees, "
                              "runtime.cpus_per_rank / runtime.gpus_per_rank, or add nodes")
        self._start_store_host()
        targets = spread_replicas(mesh.dp_replicate, self.per_rank, mesh.replica_size, nodes)
        for replica, target in enumerate(targets):
            self.slots.extend(self._start_replica(mesh, replica, target))
        self._wait_ready()

    def _start_store_host(self) -> None:
        if self.store_host is not None:
            return
        strategy = NodeAffinitySchedulingStrategy(node_id=cluster.driver_node_id(), soft=True)
        self.store_host = ray.remote(StoreHost).options(num_cpus=0, scheduling_strategy=strategy).remote()
        self.store_address = ray.get(self.store_host.address.remote(), timeout=self.start_timeout_s)

    def _start_replica(self, mesh: MeshSpec, replica: int, target: str | None) -> list[RankSlot]:
        bundles = tp_bundles(mesh, self.per_rank)
        name = f"meshpilot-replica-{replica}-{time.time_ns()}"
        if target is not None:
            # The whole replica fits one node: keep it there, preferably on the chosen node.
            group = placement_group(bundles, strategy="STRICT_PACK", name=name, _soft_target_node_id=target)
        else:
            group = placement_group(bundles, strategy="PACK", name=name)
        slots = []
        for local_rank in range(mesh.replica_size):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=local_rank // mesh.tp)
            actor = ray.remote(RankActor).options(
                num_cpus=self.per_rank.cpus, num_gpus=self.per_rank.gpus, max_concurrency=ACTOR_CONCURRENCY,
                scheduling_strategy=strategy,
            ).remote(spec=self.spec, data=self.data_ref)
            slots.append(RankSlot(actor=actor, replica=replica, placement_group=group))
        return slots

    def _wait_ready(self) -> None:
        refs = [slot.actor.info.remote() for slot in self.slots]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.start_timeout_s)
        if pending:
            raise ConfigError(
                f"runtime.start_timeout_s={self.start_timeout_s:g}: only {len(ready)} of {len(refs)} rank actors "
                "started; the cluster may lack the resources it reports, or actors fail to import torch")
        for slot, info in zip(self.slots, ray.get(refs)):
            slot.node_id = info["node_id"]

    # ---------------------------------------------------------------- fan-out
    @property
    def actors(self) -> list[Any]:
        return [slot.actor for slot in self.slots]

    def configure(self, *, generation: int, mesh: MeshSpec, start: StartFrom) -> PendingCalls:
        return PendingCalls([
            slot.actor.configure.remote(generation=generation, rank=rank, mesh=mesh,
                                        store_address=self.store_address, start=start)
            for rank, slot in enumerate(self.slots)
        ])

    def run(self, *, last_step: int) -> PendingCalls:
        return PendingCalls([slot.actor.run.remote(last_step=last_step) for slot in self.slots])

    def poll(self, timeout: float) -> dict[int, Any]:
        """Heartbeats (with queued reports) of every rank that answers within ``timeout``."""
        calls = PendingCalls([slot.actor.poll.remote() for slot in self.slots])
        calls.collect(timeout)
        return calls.results

    def request_stop(self) -> None:
        for slot in self.slots:
            slot.actor.request_stop.remote()

    def shutdown(self, *, grace_s: float = 5.0) -> None:
        """Stop every actor and free every placement group; safe to call twice."""
        refs = [slot.actor.shutdown.remote() for slot in self.slots]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        for slot in self.slots:
            ray.kill(slot.actor, no_restart=True)
        for group in {id(s.placement_group): s.placement_group for s in self.slots}.values():
            remove_placement_group(group)
        self.slots = []
        if self.store_host is not None:
            ray.kill(self.store_host, no_restart=True)
            self.store_host = None
