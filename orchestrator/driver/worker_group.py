"""The job's rank actors and where they run: a pool of slots, placement groups, fan-out calls.

Runs on the driver. Actors are started a replica group at a time: one placement group per
replica group (bundles = whole tensor-parallel groups, strategy STRICT_PACK on a soft target
node chosen to spread replicas over nodes, or PACK when a replica group is larger than any
node), one actor per rank, plus one ``StoreHost`` actor on the driver's node.

Every actor is a slot in the pool: ``active`` slots hold the ranks of the current mesh, in
rank order; ``warm`` slots are started, healthy and idle (spares, or survivors of a replica
group that broke) and can take a rank at the next reconfiguration; ``starting`` slots are
still coming up in the background; ``lingering`` slots lost their rank (stuck in a failed
generation) but stay alive until a restore has read the peer-memory snapshots they hold. The
controller decides who is active; this module only starts, calls and stops actors. Calls to
many ranks return ``PendingCalls`` (``orchestrator.driver.calls``). ``WorkerGroup`` implements
``WorkerGroupProtocol`` (``orchestrator.driver.group``), the part of it the controller uses.

With ``runtime.survive_driver_loss`` the actors, their placement groups and the store are
detached and named in the run's Ray namespace, so they outlive the driver (under a lease) and a
new driver takes them over (``take_over``, from ``orchestrator/driver/adoption.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from itertools import count
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from elastic.placement import RankResources, shortfall, spread_replicas, tp_bundles
from elastic.spec import MeshSpec
from orchestrator.driver import cluster, ray_compat
from orchestrator.driver.calls import CallFailed, PendingCalls, result_of
from orchestrator.errors import ConfigError, UserError
from workers.actor import RankActor  # the class handle only: ray.remote needs it
from workers.faults import FaultSpec
from workers.rendezvous import StoreHost
from workers.spec import TrainSpec
from workers.spec.messages import Heartbeat, SnapshotPlan, StartFrom

log = logging.getLogger("meshpilot")

# Threads per rank actor: the loop, plus control calls (poll, stop) answered while it runs,
# and peer-memory snapshot calls (a buddy's copy, restoring ranks' reads).
ACTOR_CONCURRENCY = 8


_replica_ids = count()
_actor_ids = count()

# runtime.survive_driver_loss: the names of the run's detached actors in its Ray namespace
# (``adoption.run_namespace``). A rank actor's name says where it sits: its placement group's
# name and bundle, which a driver adopting it needs to free them at the end.
STORE_HOST_NAME = "store"
RANK_ACTOR_PREFIX = "rank|"


def rank_actor_name(group_name: str, bundle_index: int) -> str:
    """A detached rank actor's name: ``rank|<placement group name>|<bundle>|<serial>``."""
    return f"{RANK_ACTOR_PREFIX}{group_name}|{bundle_index}|{next(_actor_ids)}"


@dataclass(frozen=True)
class AdoptedActor:
    """A live detached rank actor a new driver adopts: its handle, where it sits, and its rank."""

    actor: Any
    placement_group: Any
    placement_group_name: str
    bundle_index: int
    node_id: str | None


class SlotState(StrEnum):
    """Where a rank actor is in its life: see the module docstring."""

    STARTING = "starting"
    WARM = "warm"
    ACTIVE = "active"
    LINGERING = "lingering"  # lost its rank; serves its peer-memory snapshots to a restore, then killed


@dataclass(eq=False)
class RankSlot:
    """One rank actor and where it sits."""

    actor: Any
    placement_group: PlacementGroup
    # Actors started together (one placement group) share this id: a replica group's worth.
    batch_id: int
    node_id: str | None = None
    state: SlotState = SlotState.STARTING
    ready_ref: Any = None
    bundle_index: int = 0  # its bundle (one tensor-parallel group's worth) in the placement group
    # A ``poll`` call that has not answered yet: its answer holds the reports it drained.
    unanswered_poll: Any = None


class WorkerGroup:
    """All rank actors of one job (driver side)."""

    def __init__(self, *, spec: TrainSpec, data: bytes | None, per_rank: RankResources, start_timeout_s: float) -> None:
        self.spec = spec
        self.per_rank = per_rank
        self.start_timeout_s = start_timeout_s
        self.data_ref = ray.put(data)
        self.slots: list[RankSlot] = []
        self.active: list[RankSlot] = []
        self.store_host: Any = None  # the StoreHost actor's handle, once started
        self.store_address: tuple[str, int] | None = None
        # Nodes announced as going away (a cloud notice Ray does not know of): never used again.
        self.avoid_nodes: set[str] = set()
        # Nodes of replaced stragglers (a throttled device, a flaky link): new actors go elsewhere
        # while another node has room.
        self.suspect_nodes: set[str] = set()
        # Ranks per bundle of each placement group (by id): the tensor-parallel degree it was made for.
        self._bundle_ranks: dict[int, int] = {}
        # Each placement group's name (by id): a detached rank actor's name says where it sits.
        self._group_names: dict[int, str] = {}
        # Why background starts failed, each logged once.
        self._start_failures: set[str] = set()

    # ------------------------------------------------------------------ start
    def start(self, mesh: MeshSpec, *, spare_replicas: int = 0) -> None:
        """Place and start one actor per rank of ``mesh`` and make them active, in rank order,
        plus ``spare_replicas`` replica groups' worth of warm spares, all before returning.

        Raises ConfigError if the cluster cannot hold the mesh or the actors do not start.
        """
        nodes = cluster.alive_nodes()
        problem = shortfall(mesh.with_replicas(mesh.dp_replicate + spare_replicas), self.per_rank, nodes)
        if problem:
            spares = f" plus {spare_replicas} spare replica groups" if spare_replicas else ""
            raise ConfigError(
                f"parallelism: {mesh.describe()}{spares} cannot be placed: {problem}; lower the "
                "degrees, elastic.spare_actors, runtime.cpus_per_rank / runtime.gpus_per_rank, "
                "or add nodes"
            )
        address_ref = self._start_store_host()
        targets = spread_replicas(mesh.dp_replicate + spare_replicas, self.per_rank, mesh.replica_size, nodes)
        started = [slot for target in targets for slot in self._start_replica(mesh, target)]
        # The store and the ranks start side by side: each is a process importing its modules.
        refs = [slot.ready_ref for slot in started]
        ready, pending = ray.wait([address_ref, *refs], num_returns=len(refs) + 1, timeout=self.start_timeout_s)
        if pending:
            raise ConfigError(
                f"runtime.start_timeout_s={self.start_timeout_s:g}: only {len(ready)} of {len(refs) + 1} actors "
                "(the ranks' and the store's) started; the cluster may lack the resources it reports, or "
                "actors fail to import torch"
            )
        address, *infos = [_started(ref) for ref in (address_ref, *refs)]
        self.store_address = address
        for slot, info in zip(started, infos):
            self._mark_ready(slot, info)
        self.set_active(started[: mesh.world_size])

    def start_replica_in_background(self, mesh: MeshSpec) -> bool:
        """Start one replica group's worth of actors without waiting (or fill the vacated bundles
        of the job's placement groups, see ``_refill_vacated_bundles``); False if nothing has
        room now."""
        if self._refill_vacated_bundles():
            return True
        nodes = [node for node in cluster.free_nodes() if node.node_id not in self.avoid_nodes]
        trusted = [node for node in nodes if node.node_id not in self.suspect_nodes]
        if not shortfall(mesh.with_replicas(1), self.per_rank, trusted):
            nodes = trusted
        elif shortfall(mesh.with_replicas(1), self.per_rank, nodes):
            return False
        target = spread_replicas(1, self.per_rank, mesh.replica_size, nodes)[0]
        self._start_replica(mesh, target)
        return True

    def _refill_vacated_bundles(self) -> bool:
        """Start actors in bundles whose actors are all gone, once Ray has placed the bundle on a
        live node: when a node dies, Ray re-places a placement group's bundles that were there
        onto a node with room (a new one), and holds its resources for them; other actors could
        not use them. True if any were started."""
        alive = {node.node_id for node in cluster.alive_nodes()} - self.avoid_nodes
        started = False
        for group in {id(slot.placement_group): slot.placement_group for slot in self.slots}.values():
            used = {slot.bundle_index for slot in self.slots if slot.placement_group is group}
            placed = _placed_bundles(group)
            per_bundle = self._bundle_ranks.get(id(group), 1)
            for index, node_id in sorted(placed.items()):
                if index not in used and node_id in alive:
                    batch_id = next(_replica_ids)
                    self.slots.extend(self._start_actor(group, index, batch_id) for _ in range(per_bundle))
                    started = True
        return started

    def refresh(self) -> list[RankSlot]:
        """Move actors that finished starting to ``warm``; returns them. Never blocks."""
        starting = [slot for slot in self.slots if slot.state == SlotState.STARTING]
        if not starting:
            return []
        ready, _ = ray.wait([s.ready_ref for s in starting], num_returns=len(starting), timeout=0)
        warmed = []
        for slot in starting:
            if slot.ready_ref in ready:
                result = result_of(slot.ready_ref)
                if isinstance(result, CallFailed):
                    # Not silent: a node that can never start a rank would otherwise keep the
                    # job from growing back without a word. Once per cause: starts are retried.
                    if result.message not in self._start_failures:
                        self._start_failures.add(result.message)
                        log.warning("an actor started in the background could not start: %s", result.message)
                    self.remove([slot])
                    continue
                self._mark_ready(slot, result)
                warmed.append(slot)
        return warmed

    def _mark_ready(self, slot: RankSlot, info: dict[str, Any]) -> None:
        slot.node_id = info["node_id"]
        slot.state = SlotState.WARM

    def _start_store_host(self) -> Any:
        """Start the rendezvous store's actor (once); returns a ref to its (host, port)."""
        if self.store_host is None:
            # Hard affinity: the store must outlive every rank, so it lives where the driver does.
            strategy = NodeAffinitySchedulingStrategy(node_id=cluster.driver_node_id(), soft=False)
            self.store_host = (
                ray.remote(StoreHost)
                .options(num_cpus=0, scheduling_strategy=strategy, **self._detached(STORE_HOST_NAME))
                .remote(lease_s=self.spec.driver_lease_s)
            )
        return self.store_host.address.remote()

    def _detached(self, name: str) -> dict[str, Any]:
        """Actor options: named and detached with ``runtime.survive_driver_loss`` (the actor outlives
        the driver under its lease, in the run's namespace, where a new driver finds it by name);
        none otherwise (the actor dies with the driver)."""
        if self.spec.driver_lease_s is None:
            return {}
        return {"name": name, "lifetime": "detached"}

    def take_over(self, ranks: Sequence[AdoptedActor], store_host: Any, store_address: tuple[str, int]) -> None:
        """A driver adopting a run (``adoption.py``): these live actors, in rank order, are the
        active slots, served by this store; nothing is started."""
        self.store_host, self.store_address = store_host, store_address
        batches: dict[str, int] = {}
        for rank in ranks:
            self._group_names[id(rank.placement_group)] = rank.placement_group_name
        slots = [
            RankSlot(
                actor=rank.actor,
                placement_group=rank.placement_group,
                batch_id=batches.setdefault(rank.placement_group_name, next(_replica_ids)),
                node_id=rank.node_id,
                bundle_index=rank.bundle_index,
            )
            for rank in ranks
        ]
        self.slots.extend(slots)
        self.set_active(slots)

    def _start_replica(self, mesh: MeshSpec, target: str | None) -> list[RankSlot]:
        bundles = tp_bundles(mesh, self.per_rank)
        batch_id = next(_replica_ids)
        name = f"meshpilot-replica-{batch_id}-{time.time_ns()}"
        lifetime = self._detached(name).get("lifetime")  # a detached actor's group outlives the driver too
        if target is not None:
            # The whole replica fits one node: keep it there, preferably on the chosen node.
            group = ray_compat.placement_group_on(target, bundles, strategy="STRICT_PACK", name=name, lifetime=lifetime)
        else:
            group = placement_group(bundles, strategy="PACK", name=name, lifetime=lifetime)
        self._bundle_ranks[id(group)] = mesh.tp
        self._group_names[id(group)] = name
        slots = [self._start_actor(group, local_rank // mesh.tp, batch_id) for local_rank in range(mesh.replica_size)]
        self.slots.extend(slots)
        return slots

    def _start_actor(self, group: PlacementGroup, bundle_index: int, batch_id: int) -> RankSlot:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index)
        actor: Any = (
            ray.remote(RankActor)
            .options(
                num_cpus=self.per_rank.cpus,
                num_gpus=self.per_rank.gpus,
                resources=dict(self.per_rank.custom) or None,
                max_concurrency=ACTOR_CONCURRENCY,
                scheduling_strategy=strategy,
                **self._detached(rank_actor_name(self._group_names.get(id(group), ""), bundle_index)),
            )
            .remote(spec=self.spec, data=self.data_ref)
        )
        return RankSlot(
            actor=actor,
            placement_group=group,
            batch_id=batch_id,
            ready_ref=actor.info.remote(),
            bundle_index=bundle_index,
        )

    # ------------------------------------------------------------- membership
    def set_active(self, slots: list[RankSlot]) -> None:
        """These slots, in this order, are the ranks of the next generation; others go warm."""
        for slot in self.slots:
            if slot.state == SlotState.ACTIVE:
                slot.state = SlotState.WARM
        for slot in slots:
            slot.state = SlotState.ACTIVE
        self.active = list(slots)

    def warm(self) -> list[RankSlot]:
        return [slot for slot in self.slots if slot.state == SlotState.WARM]

    def starting(self) -> list[RankSlot]:
        return [slot for slot in self.slots if slot.state == SlotState.STARTING]

    def linger(self, slots: list[RankSlot]) -> None:
        """These active slots lose their rank but their actors stay alive (see ``SlotState.LINGERING``)."""
        for slot in slots:
            slot.state = SlotState.LINGERING
        self.active = [slot for slot in self.active if slot.state == SlotState.ACTIVE]

    def lingering(self) -> list[RankSlot]:
        return [slot for slot in self.slots if slot.state == SlotState.LINGERING]

    def kill(self, slots: list[RankSlot]) -> None:
        """Kill these actors now; their slots stay (ranks keep their numbers) until removed."""
        for slot in slots:
            ray.kill(slot.actor, no_restart=True)

    def remove(self, slots: list[RankSlot]) -> None:
        """Kill these actors (dead ones too: harmless) and forget them; free emptied placement groups."""
        doomed = {id(slot) for slot in slots}
        for slot in slots:
            ray.kill(slot.actor, no_restart=True)
        self.slots = [slot for slot in self.slots if id(slot) not in doomed]
        self.active = [slot for slot in self.active if id(slot) not in doomed]
        still_used = {id(slot.placement_group) for slot in self.slots}
        for group in {id(s.placement_group): s.placement_group for s in slots}.values():
            if id(group) not in still_used:
                remove_placement_group(group)

    # ---------------------------------------------------------------- fan-out
    def configure(
        self,
        *,
        generation: int,
        mesh: MeshSpec,
        starts: list[StartFrom],
        sync_replicas: bool,
        faults: tuple[FaultSpec, ...] = (),
        snapshots: Sequence[SnapshotPlan | None] = (),
    ) -> PendingCalls:
        plans = list(snapshots) or [None] * len(self.active)
        return PendingCalls(
            [
                slot.actor.configure.remote(
                    generation=generation,
                    rank=rank,
                    mesh=mesh,
                    store_address=self.store_address,
                    start=start,
                    sync_replicas=sync_replicas,
                    faults=faults,
                    snapshots=plan,
                )
                for rank, (slot, start, plan) in enumerate(zip(self.active, starts, plans))
            ]
        )

    def run(self, *, last_step: int) -> PendingCalls:
        return PendingCalls([slot.actor.run.remote(last_step=last_step) for slot in self.active])

    def poll(self, timeout: float) -> dict[int, Heartbeat | CallFailed]:
        """Heartbeats (with queued reports) of every active rank that answers within ``timeout``.

        A rank's poll that has not answered in time is waited for again by the next one, never
        called anew: once the actor runs it, the reports it drained from the rank's channel
        live only in that answer (on a loaded machine, a pause's last step reports were lost so)."""
        for slot in self.active:
            if slot.unanswered_poll is None:
                slot.unanswered_poll = slot.actor.poll.remote()
        calls = PendingCalls([slot.unanswered_poll for slot in self.active])
        calls.collect(timeout)
        for rank in calls.results:
            self.active[rank].unanswered_poll = None
        return calls.results

    def request_stop(self) -> None:
        for slot in self.active:
            slot.actor.request_stop.remote()

    def request_pause(self, generation: int, *, checkpoint: bool = False) -> None:
        """Every rank stops after the next step it commits (the step boundary)."""
        self.store_host.request_pause.remote(generation, checkpoint)

    def set_snapshot_interval(self, generation: int, interval_steps: int) -> None:
        """Every rank of ``generation`` snapshots every ``interval_steps`` steps from the next decided step."""
        self.store_host.set_snapshot_interval.remote(generation, interval_steps)

    def abort_step(self, generation: int, step: int, survivors: list[int]) -> None:
        """Veto the in-flight step of ``generation`` so that no survivor applies it, and abort
        the survivors' process groups so that none stays blocked on a lost rank."""
        if self.store_host is not None:
            ray.get(self.store_host.abort_from.remote(generation, step), timeout=10)
        for rank in survivors:
            self.active[rank].actor.abort_collectives.remote(generation)

    def shutdown(self, *, grace_s: float = 5.0) -> None:
        """Stop every actor and free every placement group; safe to call twice."""
        refs = [slot.actor.shutdown.remote() for slot in self.slots if slot.state != SlotState.STARTING]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=grace_s)
        self.remove(list(self.slots))
        if self.store_host is not None:
            ray.kill(self.store_host, no_restart=True)
            self.store_host = None


def _started(ready_ref: Any) -> Any:
    """What a started actor's first call returned; UserError when the actor could not start
    (its process died or its constructor raised: most often a node whose Python environment
    lacks what the ranks import)."""
    result = result_of(ready_ref)
    if isinstance(result, CallFailed):
        raise UserError(
            f"runtime: an actor of the job could not start on the Ray cluster ({result.message}); every "
            "node's Python environment needs meshpilot's dependencies (torch, boto3, safetensors); the "
            "actor's own log is a worker-*.err file in the Ray session's logs/ directory"
        )
    return result


def _placed_bundles(group: PlacementGroup) -> dict[int, str]:
    """Bundle index -> the node Ray placed it on, for the bundles placed now."""
    table = placement_group_table(group)
    return {int(index): node for index, node in (table.get("bundles_to_node_id") or {}).items() if node}
