"""Replica bookkeeping for a mesh change: who stays, who goes warm, who joins, what fits.

Runs on the driver, called by the controller while a generation settles or a restore waits for
actors. A replica group (one ``dp_replicate`` slice) is the unit that leaves and joins: a group
that lost a rank leaves whole, its healthy actors go warm and may refill the mesh; warm actors
started together (one placement group, one node) join together. It also says which meshes the
trainer can run (the global batch must split over them) and whether the replica groups of a
finished run ended with identical state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from elastic.hardware import gpu_spec
from elastic.planner import best_mesh
from elastic.policy import restore_mesh
from elastic.spec import MeshSpec
from orchestrator.driver import cluster
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from workers.spec import TrainSpec

log = logging.getLogger("meshpilot")


class Replicas:
    """The replica groups of the current mesh over the worker group's slots (driver side)."""

    def __init__(self, group: WorkerGroupProtocol[Slot], spec: TrainSpec) -> None:
        self.group = group
        self.spec = spec

    def node_of(self, rank: int) -> str | None:
        """The node of the actor holding ``rank`` of the current mesh (None if unknown)."""
        return self.group.active[rank].node_id if rank < len(self.group.active) else None

    def dead_nodes(self) -> set[str]:
        """The nodes of active ranks that Ray reports dead (one GCS call)."""
        nodes = {slot.node_id for slot in self.group.active if slot.node_id}
        return cluster.dead_nodes(nodes) if nodes else set()

    def unreachable_nodes(self, node_ids: set[str]) -> set[str]:
        """Those of ``node_ids`` that do not answer on the network now (a connection attempt each)."""
        return cluster.unreachable_nodes(node_ids)

    def gone_besides(self, ranks: Collection[int] = ()) -> Callable[[Slot], bool]:
        """A predicate: has an actor left the pool (removed: lost, drained, shut down), or does it
        hold one of ``ranks`` of the current mesh (about to leave)? Judged on the pool as it is now."""
        leaving = {id(self.group.active[rank]) for rank in ranks if rank < len(self.group.active)}
        pool = [*self.group.active, *self.group.warm(), *self.group.starting(), *self.group.lingering()]
        live = {id(slot) for slot in pool} - leaving
        return lambda slot: id(slot) not in live

    def shrink(
        self, mesh: MeshSpec, lost: Collection[int], draining: Collection[int], *, drop: tuple[int, ...], refill: int
    ) -> tuple[list[Slot], list[Slot]]:
        """Ranks that stay (``drop``ped replica groups leave) and warm actors for ``refill``
        replica groups, or none if there are too few."""
        kept, pool = self.split(mesh, lost, draining, drop)
        return kept, self.pick_warm(pool, refill * mesh.replica_size, suspect=self.group.suspect_nodes)

    def grow(self, mesh: MeshSpec, *, add: int) -> tuple[list[Slot], list[Slot]]:
        """Every active rank stays; warm actors for ``add`` more replica groups, or none."""
        return list(self.group.active), self.pick_warm(
            self.group.warm(), add * mesh.replica_size, suspect=self.group.suspect_nodes
        )

    def release(self, lost: Collection[int], draining: Collection[int], *, linger: Collection[int] = ()) -> None:
        """No replica group survived: lost and draining actors are removed (the ``linger`` ones
        once a restore has read their peer-memory snapshots), the others go warm."""
        active = self.group.active
        removed = [active[rank] for rank in sorted((set(lost) | set(draining)) - set(linger))]
        self.group.linger([active[rank] for rank in sorted(linger)])
        self.group.remove(removed)
        self.group.set_active([])

    def split(
        self, mesh: MeshSpec, lost: Collection[int], draining: Collection[int], drop: tuple[int, ...]
    ) -> tuple[list[Slot], list[Slot]]:
        """Survivors to keep (rank order) and the pool to refill from: the warm actors and the
        healthy actors of dropped replicas. Lost and draining ranks' actors are removed."""
        active = self.group.active
        gone = [active[rank] for rank in sorted(set(lost) | set(draining)) if rank < len(active)]
        kept: list[Slot] = []
        released: list[Slot] = []
        for replica in mesh.replica_groups():
            slots = [active[rank] for rank in replica.ranks]
            if replica.index in drop:
                released.extend(slot for slot in slots if slot not in gone)
            else:
                kept.extend(slots)
        self.group.remove(gone)
        return kept, self.group.warm() + released

    def leaving(self, nodes: set[str], retiring: Collection[object] = ()) -> frozenset[int]:
        """The active ranks on ``nodes`` (going away) or held by ``retiring`` actors (their
        process was told to end); warm and starting actors of either are removed."""
        stale = [
            slot for slot in self.group.warm() + self.group.starting() if slot.node_id in nodes or slot in retiring
        ]
        if stale:
            self.group.remove(stale)
        return frozenset(
            rank for rank, slot in enumerate(self.group.active) if slot.node_id in nodes or slot in retiring
        )

    def top_up(self, mesh: MeshSpec, *, wanted_ranks: int) -> None:
        """Start a replica group's worth of actors in the background while the pool (warm and
        starting) holds fewer than ``wanted_ranks``; one group per call."""
        if wanted_ranks > len(self.group.warm()) + len(self.group.starting()):
            self.group.start_replica_in_background(mesh)

    @staticmethod
    def pick_warm(pool: Sequence[Slot], count: int, *, suspect: Collection[str] = ()) -> list[Slot]:
        """``count`` actors of ``pool``, or none if it has fewer: actors started together (one
        placement group, one node) stay together, and within a group the pool's order (the order
        they started in) is kept: the same history hands the same ranks to the same actors, so
        a chaos seed's later faults hit the same actors when it is replayed (not their memory
        addresses' order). Actors on ``suspect`` nodes (a replaced straggler's) come last."""
        # Stable: the pool's order within a group.
        ordered = sorted(pool, key=lambda slot: (slot.node_id in suspect, slot.batch_id))
        return ordered[:count] if len(ordered) >= count else []

    @staticmethod
    def healthy_in_hit_replicas(
        mesh: MeshSpec, lost: Collection[int], draining: Collection[int], stateless: Collection[int] = ()
    ) -> int:
        """Ranks neither lost nor draining in replica groups that lost, drain or cannot keep
        (``stateless``: holding no state) one: they go warm."""
        hit = {mesh.replica_of(rank) for rank in set(lost) | set(draining) | set(stateless)}
        return sum(
            1
            for replica in mesh.replica_groups()
            if replica.index in hit
            for rank in replica.ranks
            if rank not in lost and rank not in draining
        )

    def fits(self, mesh: MeshSpec) -> bool:
        """Whether the trainer can run ``mesh``: the global batch splits into its rounds."""
        return self.spec.batch.fits(mesh.dp)

    def gather(self, mesh: MeshSpec, *, start_more: bool = True) -> tuple[list[Slot], MeshSpec | None]:
        """Warm actors for a restore onto ``mesh``, and the mesh they can hold now; while too few
        are warm and none are starting, a replica group's worth more starts in the background
        (unless not ``start_more``: the restore goes on with what is warm, and the running job
        starts actors for the mesh it runs)."""
        self.group.refresh()
        warm = self.group.warm()
        if start_more and len(warm) < mesh.world_size and not self.group.starting():
            self.group.start_replica_in_background(mesh)  # False when no node has room
        return warm, self.restore_target(mesh, len(warm))

    def restore_target(self, mesh: MeshSpec, available: int) -> MeshSpec | None:
        """The mesh to restore onto with ``available`` ranks: the planner's pick keeping tp and pp
        when it fits what the trainer can run, else the largest mesh keeping them; when none
        does (fewer ranks than a tensor-parallel group or a pipeline), the planner's pick among
        every degree (a restore reshards any of them)."""
        if available >= mesh.world_size:
            return mesh
        if available < 1:
            return None
        planned = self._planned(mesh, available, fixed={"tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp})
        if planned is not None:
            return planned
        kept = restore_mesh(mesh, available_ranks=available, fits=self.fits)
        return kept if kept is not None else self._planned(mesh, available, fixed={})

    def _planned(self, mesh: MeshSpec, available: int, *, fixed: dict[str, int]) -> MeshSpec | None:
        planned = best_mesh(
            self.spec.model,
            available_ranks=available,
            gpus_per_node=max(1, fixed.get("tp", 1)),
            hardware=gpu_spec(),
            global_batch=self.spec.global_batch,
            seq_len=self.spec.seq_len,
            fixed=fixed,
        )
        return planned if planned is not None and planned.world_size <= available and self.fits(planned) else None


def replicas_consistent(mesh: MeshSpec, outcomes: Mapping[int, Any]) -> bool | None:
    """Whether every replica group ended with bitwise-identical state (None with one replica
    group); logs where they diverged."""
    by_slice: dict[tuple[int, int, int, int], set[str]] = {}
    for rank, outcome in outcomes.items():
        coords = mesh.coords(rank)
        by_slice.setdefault((coords.pp, coords.dp_shard, coords.cp, coords.tp), set()).add(outcome.state_digest)
    diverged = sorted(key for key, digests in by_slice.items() if len(digests) > 1)
    if diverged:
        log.error("replica groups diverged at (pp, dp_shard, cp, tp) = %s", diverged)
    return not diverged if mesh.dp_replicate > 1 else None


def replicas_of(mesh: MeshSpec, ranks: Collection[int]) -> int:
    """How many replica groups ``ranks`` touch."""
    return len({mesh.replica_of(rank) for rank in ranks})
