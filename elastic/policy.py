"""What to do when ranks are lost or capacity comes back: plain values in, a decision out.

Pure (no ray, no torch). The driver's detector describes the job in a ``GroupStatus``; the
failure policy and the scaling policy each return one decision value; the controller carries
it out. Replica groups (``dp_replicate`` slices) are the unit: a replica group with any lost
or draining rank leaves the mesh whole, its healthy ranks become warm actors, and warm actors
are what refills or grows the mesh (taking their state from a surviving replica, peer to
peer). When no complete replica survives, the job restores the newest state that is still
whole: a peer-memory snapshot (every lost rank's copy lives on another rank) when it is at
least as new as the newest committed checkpoint, else that checkpoint.

Decisions:
    Continue()                              nothing to do
    Shrink(new_mesh, drop, refill)          go on without replica groups ``drop``; ``refill``
                                            of them are rebuilt at once from warm actors
    Grow(new_mesh, add)                     add ``add`` replica groups built from warm actors
    Reshape(new_mesh)                       move to a mesh differing in any degree at a step
                                            boundary, every rank loading the boundary's
                                            peer-memory snapshot resharded (a grow of dp_shard,
                                            tp or pp once capacity is back)
    RestoreFromCheckpoint(step, new_mesh, source)
                                            no replica survived: reload state from peer
                                            memory or storage, resharded to ``new_mesh``
    Fail(reason)                            give up, saying why
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from elastic.spec import MeshSpec


class StateSource(StrEnum):
    """Where a mesh change takes the state of ranks that do not hold it."""

    REPLICA = "replica"  # a surviving replica group, peer to peer
    PEER_MEMORY = "peer_memory"  # the ranks' in-memory snapshots and their copies on other ranks
    STORAGE = "storage"  # the newest committed checkpoint


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class Shrink:
    new_mesh: MeshSpec
    drop: tuple[int, ...]
    refill: int = 0


@dataclass(frozen=True)
class Grow:
    new_mesh: MeshSpec
    add: int


@dataclass(frozen=True)
class Reshape:
    new_mesh: MeshSpec


@dataclass(frozen=True)
class RestoreFromCheckpoint:
    step: int | None  # None: the latest committed checkpoint
    new_mesh: MeshSpec
    source: StateSource = StateSource.STORAGE


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Continue | Shrink | Grow | Reshape | RestoreFromCheckpoint | Fail


@dataclass(frozen=True)
class GroupStatus:
    """The job as the detector sees it at one moment (driver side)."""

    mesh: MeshSpec
    # Ranks whose process or state is gone: dead, raised, hung, unresponsive.
    lost_ranks: frozenset[int] = frozenset()
    # Ranks that are healthy but must leave (their node is being drained or preempted).
    draining_ranks: frozenset[int] = frozenset()
    # Healthy, idle actors that can take a rank now (spares, survivors of broken replicas).
    warm_actors: int = 0
    # Newest committed checkpoint step, if checkpoints are on and one exists.
    checkpoint_step: int | None = None
    # Newest peer-memory snapshot step that the ranks still hold whole (after these losses).
    memory_step: int | None = None
    # When the detector made this status (seconds, any monotonic clock).
    time: float = 0.0
    # Steps the job completed so far (redone ones included: it never goes back): a loss before
    # any step since the previous one belongs to the same incident (its echo, or a fault
    # during its recovery).
    completed_step: int = 0

    def hit_replicas(self) -> tuple[int, ...]:
        touched = self.lost_ranks | self.draining_ranks
        return tuple(sorted({self.mesh.replica_of(rank) for rank in touched}))


# A predicate: can the job run on this mesh (batch split, resources, ...)?
MeshFits = Callable[[MeshSpec], bool]


@dataclass
class FailurePolicy:
    """Recover in place when a replica survives, else restore, within a failure budget.

    The budget counts incidents, not echoes: losses found before the job completed a step since
    the previous one (a peer's death seen late, a fault during the recovery) belong to that
    incident. An incident whose recovery keeps failing without completing a step ends the run
    after ``max_failures`` attempts.
    """

    min_replicas: int = 1
    max_replicas: int | None = None
    max_failures: int = 5
    window_s: float = 3600.0
    failure_times: list[float] = field(default_factory=list)
    # The step completed when the current incident began, and its recovery attempts so far.
    incident_step: int | None = None
    attempts: int = 0

    def decide(self, status: GroupStatus, *, fits: MeshFits, restore_mesh: Callable[[], MeshSpec | None]) -> Decision:
        """A decision for ranks lost or draining. ``restore_mesh`` picks a mesh for a restore."""
        hit = status.hit_replicas()
        if not hit:
            return Continue()
        if status.lost_ranks:
            over = self._count(status)
            if over is not None:
                return Fail(over)
        shrink = self._shrink_in_place(status, hit, fits)
        if shrink is not None:
            return shrink
        return _restore(status, hit, restore_mesh)

    def _shrink_in_place(self, status: GroupStatus, hit: tuple[int, ...], fits: MeshFits) -> Shrink | None:
        """Drop the ``hit`` replica groups and go on with the survivors, refilled from warm actors as far
        as the mesh fits; else the fewest survivors that fit. None when no replica group survives or
        no such mesh keeps ``min_replicas``."""
        mesh = status.mesh
        survivors = mesh.dp_replicate - len(hit)
        if survivors < 1:
            return None
        refill = min(len(hit), status.warm_actors // mesh.replica_size)
        if self.max_replicas is not None:
            refill = min(refill, max(0, self.max_replicas - survivors))
        while refill >= 0:
            candidate = mesh.with_replicas(survivors + refill)
            if fits(candidate):
                break
            refill -= 1
        else:
            candidate = None
        if candidate is not None and candidate.dp_replicate >= self.min_replicas:
            return Shrink(candidate, drop=hit, refill=refill)
        smallest = _fewest_replicas_that_fit(mesh, survivors, fits)
        if smallest is not None and smallest.dp_replicate >= self.min_replicas:
            return Shrink(smallest, drop=hit + _extra_drops(mesh, hit, survivors - smallest.dp_replicate), refill=0)
        return None

    def _count(self, status: GroupStatus) -> str | None:
        """Count a loss against the budget; the reason to give up, or None."""
        if self.incident_step is not None and status.completed_step <= self.incident_step:
            self.attempts += 1  # the same incident: no step completed since it began
            if self.attempts > self.max_failures:
                return (
                    f"recovery failed {self.attempts} times in a row without completing a step after "
                    f"step {self.incident_step} (elastic.max_failures={self.max_failures})"
                )
            return None
        self.incident_step, self.attempts = status.completed_step, 1
        self.failure_times.append(status.time)
        self.failure_times = [t for t in self.failure_times if status.time - t <= self.window_s]
        if len(self.failure_times) > self.max_failures:
            return _budget_reason(self, len(self.failure_times))
        return None


def _restore(status: GroupStatus, hit: tuple[int, ...], restore_mesh: Callable[[], MeshSpec | None]) -> Decision:
    """No replica group can go on: restore from the newer of peer memory and the last committed
    checkpoint onto the mesh ``restore_mesh`` picks, or fail saying what is missing."""
    from_memory = status.memory_step is not None and (
        status.checkpoint_step is None or status.memory_step >= status.checkpoint_step
    )
    if status.checkpoint_step is None and not from_memory:
        return Fail(
            f"no complete replica group survived ({len(hit)} of {status.mesh.dp_replicate} hit), no peer-memory "
            "snapshot is whole, and there is no committed checkpoint to restore; set checkpoint.uri, or "
            "raise parallelism.dp_replicate"
        )
    target = restore_mesh()
    if target is None:
        return Fail(
            "no complete replica group survived and the remaining resources cannot hold any mesh "
            "for this model and batch"
        )
    if from_memory:
        return RestoreFromCheckpoint(step=status.memory_step, new_mesh=target, source=StateSource.PEER_MEMORY)
    return RestoreFromCheckpoint(step=status.checkpoint_step, new_mesh=target)


@dataclass
class ScalingPolicy:
    """Grow back, at a step boundary, when warm actors can form whole replica groups; with
    peer-memory snapshots, also back to the configured ``target_mesh`` when the mesh shrank in
    another degree (a restore onto fewer ranks) and the warm actors can fill it."""

    target_replicas: int
    max_replicas: int | None = None
    target_mesh: MeshSpec | None = None

    def decide(self, mesh: MeshSpec, *, warm_actors: int, fits: MeshFits, reshape: bool = False) -> Decision:
        if reshape and (missing := self.reshape_shortfall(mesh)) and warm_actors >= missing:
            assert self.target_mesh is not None, "a shortfall exists only towards a target mesh"
            if fits(self.target_mesh):
                return Reshape(self.target_mesh)
        ceiling = self.target_replicas if self.max_replicas is None else self.max_replicas
        room = ceiling - mesh.dp_replicate
        add = min(room, warm_actors // mesh.replica_size)
        while add > 0:
            candidate = mesh.with_replicas(mesh.dp_replicate + add)
            if fits(candidate):
                return Grow(candidate, add=add)
            add -= 1
        return Continue()

    def wanted_replicas(self, mesh: MeshSpec) -> int:
        """Replica groups the job would add if it had the actors."""
        ceiling = self.target_replicas if self.max_replicas is None else self.max_replicas
        return max(0, ceiling - mesh.dp_replicate)

    def reshape_shortfall(self, mesh: MeshSpec) -> int:
        """Ranks a reshape back to ``target_mesh`` needs beyond ``mesh``'s (0: none is due,
        the mesh differs from the target in the replica degree at most)."""
        target = self.target_mesh
        if target is None or mesh.with_replicas(target.dp_replicate) == target:
            return 0
        return max(0, target.world_size - mesh.world_size)


def _budget_reason(policy: FailurePolicy, recent: int) -> str:
    return (
        f"{recent} failures within {policy.window_s:g} s exceed the failure budget "
        f"(elastic.max_failures={policy.max_failures}, elastic.failure_window_s={policy.window_s:g})"
    )


def _fewest_replicas_that_fit(mesh: MeshSpec, survivors: int, fits: MeshFits) -> MeshSpec | None:
    for count in range(survivors, 0, -1):
        candidate = mesh.with_replicas(count)
        if fits(candidate):
            return candidate
    return None


def _extra_drops(mesh: MeshSpec, hit: tuple[int, ...], count: int) -> tuple[int, ...]:
    """Healthy replica groups to leave out as well (highest index first) when the batch needs it."""
    healthy = [index for index in range(mesh.dp_replicate) if index not in hit]
    return tuple(sorted(healthy[len(healthy) - count :])) if count > 0 else ()


def restore_mesh(mesh: MeshSpec, *, available_ranks: int, fits: MeshFits) -> MeshSpec | None:
    """The mesh to restore a checkpoint onto with ``available_ranks`` ranks, or None.

    Keeps the tensor- and pipeline-parallel degrees (the per-rank memory the user sized) and
    gives up data parallelism first: the largest world that fits, ties broken towards more
    replica groups (more resilience). The checkpoint reader reshards whatever changes.
    """
    best: MeshSpec | None = None
    for replicas in range(mesh.dp_replicate, 0, -1):
        for shards in range(mesh.dp_shard, 0, -1):
            candidate = MeshSpec(dp_replicate=replicas, dp_shard=shards, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp)
            if candidate.world_size > available_ranks or not fits(candidate):
                continue
            if best is None or (candidate.world_size, candidate.dp_replicate) > (best.world_size, best.dp_replicate):
                best = candidate
    return best
