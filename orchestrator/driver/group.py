"""What the controller needs of a worker group: the protocol ``WorkerGroup`` implements.

Runs on the driver. ``orchestrator.driver.worker_group.WorkerGroup`` starts real rank actors
on Ray; the unit tests step the controller with a fake that implements the same protocol
(``Controller.worker_group_class``). Slots are opaque to the controller apart from where they
run (``node_id``) and which actors started together (``batch_id``), so the protocol is generic
in the slot type each implementation uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from elastic.placement import RankResources
from elastic.spec import MeshSpec
from orchestrator.driver.calls import CallFailed
from workers.faults import FaultSpec
from workers.spec import TrainSpec
from workers.spec.messages import Heartbeat, SnapshotPlan, StartFrom


class Slot(Protocol):
    """One rank actor, as the controller sees it."""

    @property
    def node_id(self) -> str | None: ...

    @property
    def batch_id(self) -> int: ...  # actors started together (one placement group) share it


class Calls(Protocol):
    """One method called on many ranks; results (return values or ``CallFailed``) by rank."""

    @property
    def refs(self) -> Sequence[Any]: ...

    @property
    def results(self) -> dict[int, Any]: ...

    @property
    def done(self) -> bool: ...

    def collect(self, timeout: float, *, first: bool = False) -> dict[int, Any]: ...


SlotT = TypeVar("SlotT", bound=Slot)


class WorkerGroupProtocol(Protocol[SlotT]):
    """A pool of rank actors: ``active`` ones hold the mesh's ranks in rank order, ``warm``
    ones are started and idle, ``starting`` ones are still coming up, ``lingering`` ones lost
    their rank but serve their peer-memory snapshots until a restore has read them."""

    avoid_nodes: set[str]  # nodes announced as going away: never used again
    suspect_nodes: set[str]  # nodes of replaced stragglers: used for new actors only when no other has room

    def __init__(
        self, *, spec: TrainSpec, data: bytes | None, per_rank: RankResources, start_timeout_s: float
    ) -> None: ...

    @property
    def active(self) -> Sequence[SlotT]: ...

    # membership
    def start(self, mesh: MeshSpec, *, spare_replicas: int = 0) -> None: ...
    def start_replica_in_background(self, mesh: MeshSpec) -> bool: ...
    def refresh(self) -> list[SlotT]: ...
    def warm(self) -> list[SlotT]: ...
    def starting(self) -> list[SlotT]: ...
    def linger(self, slots: list[SlotT]) -> None: ...
    def lingering(self) -> list[SlotT]: ...
    def set_active(self, slots: list[SlotT]) -> None: ...
    def kill(self, slots: list[SlotT]) -> None: ...
    def remove(self, slots: list[SlotT]) -> None: ...

    # fan-out to the active ranks
    def configure(
        self,
        *,
        generation: int,
        mesh: MeshSpec,
        starts: list[StartFrom],
        sync_replicas: bool,
        faults: tuple[FaultSpec, ...] = (),
        snapshots: Sequence[SnapshotPlan | None] = (),
    ) -> Calls: ...
    def run(self, *, last_step: int) -> Calls: ...
    def poll(self, timeout: float) -> dict[int, Heartbeat | CallFailed]: ...
    def request_stop(self) -> None: ...
    def request_pause(self, generation: int, *, checkpoint: bool = False) -> None: ...
    def set_snapshot_interval(self, generation: int, interval_steps: int) -> None: ...
    def abort_step(self, generation: int, step: int, survivors: list[int]) -> None: ...
    def shutdown(self, *, grace_s: float = 5.0) -> None: ...
