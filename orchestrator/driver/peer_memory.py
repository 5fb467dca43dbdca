"""The driver's book of peer-memory snapshots: who holds what, and which snapshot a recovery can use.

Runs on the driver (no torch). Each generation, ``plans`` gives every rank its buddy: the next
rank, in rank order, on another node (any other rank on a one-node cluster), so one node's loss
leaves a copy of each of its ranks' snapshots elsewhere. The ranks report their snapshot layout
once per generation (``SnapshotLayoutReport``) and each snapshot once it is copied
(``SnapshotReport``). ``recoverable`` finds the newest snapshot every slice of which is still
held by a live actor, and ``source`` describes it to the restoring ranks (``MemorySource``: the
index the checkpoint reader reads, and the actors holding each object).

How often snapshots are taken is the cadence's (``elastic/snapshot_cadence.py``): the book feeds
it each report's cost and, when the interval changes, publishes it to the current generation's
ranks (``publish_interval``, given to the constructor: the worker group's store) and plans the
next generations with it.

A snapshot is complete when every rank reported it, or when some rank of its generation applied
a later step: a rank votes on a step only once its previous snapshot reached its buddy, and no
step is applied before every rank voted on it (``workers/peer_snapshots.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from checkpointing.manifest import build_manifest
from checkpointing.spec import ShardReport
from elastic.snapshot_cadence import SnapshotCadence
from elastic.spec import MeshSpec
from orchestrator.config import JobConfig
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.observe.events import EventLog
from workers.peer_snapshots import LABELS_KEPT, snapshot_key
from workers.spec.messages import (
    MemoryRestoreReport,
    MemorySource,
    ReportKind,
    SnapshotLayoutReport,
    SnapshotPlan,
    SnapshotReport,
)

log = logging.getLogger("meshpilot")


@dataclass
class _Generation:
    """One generation's ranks (actors by rank), layouts and snapshots."""

    number: int
    mesh: MeshSpec
    slots: list[Any]
    buddies: list[int | None]
    layouts: dict[int, SnapshotLayoutReport] = field(default_factory=dict)
    # step -> ranks whose snapshot of it is held (rank -> copied to the buddy too)
    reported: dict[int, dict[int, bool]] = field(default_factory=dict)
    # The newest step some rank applied: every snapshot before it is complete.
    applied: int = 0
    memory_bytes_emitted: bool = False


class PublishInterval(Protocol):
    """Tells the ranks of ``generation`` to snapshot every ``interval_steps`` steps (driver side;
    ``WorkerGroup.set_snapshot_interval``)."""

    def __call__(self, generation: int, interval_steps: int) -> None: ...


def _publish_nowhere(generation: int, interval_steps: int) -> None:
    return None


@dataclass(frozen=True)
class RecoveryPoint:
    """A snapshot a recovery can load: its generation and step."""

    generation: int
    step: int


class SnapshotBook:
    """Peer-memory snapshots of the run (driver side); see the module docstring."""

    def __init__(
        self,
        events: EventLog,
        *,
        cadence: SnapshotCadence,
        memory_limit_bytes: int | None,
        model: dict[str, Any],
        publish_interval: PublishInterval = _publish_nowhere,
    ) -> None:
        self.events = events
        self.cadence = cadence
        self.publish_interval = publish_interval
        self.memory_limit_bytes = memory_limit_bytes
        self.model = model
        self._generations: dict[int, _Generation] = {}
        self._restore_bytes = 0  # read from other ranks' memory by the restore in progress
        # Snapshots known unusable (a restore from them failed): never chosen again.
        self._unusable: set[RecoveryPoint] = set()

    @property
    def interval_steps(self) -> int:
        return self.cadence.interval

    @property
    def enabled(self) -> bool:
        return self.interval_steps > 0

    # ------------------------------------------------------------------ plans
    def plans(self, generation: int, mesh: MeshSpec, slots: Sequence[Any]) -> list[SnapshotPlan | None]:
        """Every rank's snapshot plan for a new generation (None for all when snapshots are off)."""
        if not self.enabled:
            return [None] * len(slots)
        buddies = buddy_ranks([getattr(slot, "node_id", None) for slot in slots])
        self._generations[generation] = _Generation(generation, mesh, list(slots), buddies)
        self._forget_old()
        return [
            SnapshotPlan(
                interval_steps=self.interval_steps,
                buddy_rank=buddy,
                buddy=None if buddy is None else getattr(slots[buddy], "actor", None),
                memory_limit_bytes=self.memory_limit_bytes,
            )
            for buddy in buddies
        ]

    # ---------------------------------------------------------------- reports
    def on_layout(self, report: SnapshotLayoutReport) -> None:
        generation = self._generations.get(report.generation)
        if generation is None:
            return
        generation.layouts[report.rank] = report
        if len(generation.layouts) == generation.mesh.world_size and not generation.memory_bytes_emitted:
            generation.memory_bytes_emitted = True
            self._emit_memory(generation)

    def on_snapshot(self, report: SnapshotReport) -> None:
        generation = self._generations.get(report.generation)
        if generation is not None:  # the owner and the buddy both report a copy: either one's word holds
            ranks = generation.reported.setdefault(report.step, {})
            ranks[report.rank] = ranks.get(report.rank, False) or report.copied
            # The ranks keep the newest LABELS_KEPT snapshots: older steps can no longer be restored.
            for old in sorted(generation.reported)[: -(LABELS_KEPT + 1)]:
                del generation.reported[old]
        if (interval := self.cadence.observe(report.step, report.cost_steps)) is not None and self._generations:
            newest = max(self._generations)
            cost, limit = self.cadence.measured_cost or 0.0, self.cadence.overhead_limit
            log.info(
                "peer-memory snapshots every %d steps from now on: a snapshot costs %.3f of a step "
                "(what the loop waits for it), elastic.snapshot_overhead_limit=%g",
                interval,
                cost,
                limit,
            )
            self.events.emit(
                "snapshot_interval",
                generation=newest,
                step=report.step,
                interval_steps=interval,
                cost_steps=round(cost, 6),
                overhead_limit=limit,
            )
            self.publish_interval(newest, interval)

    def on_restore(self, report: MemoryRestoreReport) -> None:
        self._restore_bytes += report.bytes_remote

    def take_restore_bytes(self) -> int:
        """Bytes the ranks read from other ranks' memory since the last call (one restore's)."""
        taken, self._restore_bytes = self._restore_bytes, 0
        return taken

    def applied(self, generation: int, step: int) -> None:
        """Some rank of ``generation`` applied ``step``: every snapshot before it is complete."""
        if (known := self._generations.get(generation)) is not None:
            known.applied = max(known.applied, step)

    def unusable(self, point: RecoveryPoint) -> None:
        """A restore from ``point`` failed: do not choose it again."""
        self._unusable.add(point)

    # --------------------------------------------------------------- recovery
    def recoverable(self, gone: Callable[[Any], bool]) -> RecoveryPoint | None:
        """The newest snapshot whose every object some actor still holds (``gone(slot)``: that
        actor is lost or leaving), or None."""
        best: RecoveryPoint | None = None
        for generation in self._generations.values():
            if len(generation.layouts) < generation.mesh.world_size:
                continue
            for step in sorted(generation.reported, reverse=True):
                point = RecoveryPoint(generation.number, step)
                if point in self._unusable or not self._complete(generation, step):
                    continue
                if all(self._holders(generation, step, rank, gone) for rank in range(generation.mesh.world_size)):
                    if best is None or step > best.step or (step == best.step and point.generation > best.generation):
                        best = point
                    break
        return best

    def source(self, point: RecoveryPoint, gone: Callable[[Any], bool]) -> MemorySource:
        """The index and holders of snapshot ``point`` for the restoring ranks."""
        generation = self._generations[point.generation]
        reports = []
        holders: dict[str, tuple[Any, ...]] = {}
        for rank, layout in sorted(generation.layouts.items()):
            key = snapshot_key(point.generation, point.step, rank)
            chunks = tuple(replace(chunk, key=key) for chunk in layout.chunks)
            reports.append(ShardReport(step=point.step, rank=rank, tensors=layout.tensors, chunks=chunks))
            holders[key] = tuple(slot.actor for slot in self._holders(generation, point.step, rank, gone))
        manifest = build_manifest(
            reports,
            step=point.step,
            world_size=generation.mesh.world_size,
            mesh=generation.mesh.as_dict(),
            model=self.model,
            config_hash=None,
            checked=False,
        )
        return MemorySource(manifest=manifest, holders=holders)

    # ---------------------------------------------------------------- helpers
    def _complete(self, generation: _Generation, step: int) -> bool:
        return len(generation.reported.get(step, {})) == generation.mesh.world_size or generation.applied > step

    def _holders(self, generation: _Generation, step: int, rank: int, gone: Callable[[Any], bool]) -> list[Any]:
        """The live actors holding rank ``rank``'s snapshot of ``step``: the owner, then its buddy
        once the copy was reported (a copy never confirmed is not counted on)."""
        candidates = [generation.slots[rank]]
        buddy = generation.buddies[rank]
        if buddy is not None and generation.reported.get(step, {}).get(rank):
            candidates.append(generation.slots[buddy])
        return [slot for slot in candidates if not gone(slot)]

    def _forget_old(self) -> None:
        """Keep the generations that may still hold one of the newest snapshots."""
        for number in sorted(self._generations)[: -LABELS_KEPT - 1]:
            del self._generations[number]

    def _emit_memory(self, generation: _Generation) -> None:
        """Host memory each rank holds for snapshots: two of its own and two of each rank it is the buddy of."""
        sizes = {rank: layout.bytes for rank, layout in generation.layouts.items()}
        per_rank = {rank: LABELS_KEPT * size for rank, size in sizes.items()}
        for rank, buddy in enumerate(generation.buddies):
            if buddy is not None:
                per_rank[buddy] = per_rank.get(buddy, 0) + LABELS_KEPT * sizes.get(rank, 0)
        peak = max(per_rank.values(), default=0)
        log.info(
            "peer-memory snapshots: up to %.1f MiB of host memory per rank (every %d steps, a copy on another %s)",
            peak / 2**20,
            self.interval_steps,
            "node" if _spans_nodes(generation) else "process",
        )
        self.events.emit(
            "snapshot_memory",
            generation=generation.number,
            bytes_per_rank={str(rank): value for rank, value in sorted(per_rank.items())},
            max_bytes=peak,
            limit_bytes=self.memory_limit_bytes,
        )


def snapshot_book(
    config: JobConfig, events: EventLog, router: ReportRouter, *, publish_interval: PublishInterval
) -> SnapshotBook:
    """The job's book, fed by the ranks' snapshot reports through ``router``; a new interval goes
    to the ranks through ``publish_interval``."""
    book = SnapshotBook(
        events,
        cadence=SnapshotCadence(config.elastic.snapshot_interval_steps, config.elastic.snapshot_overhead_limit),
        memory_limit_bytes=None if (limit := config.elastic.snapshot_memory_limit_mb) is None else limit << 20,
        model=config.model_spec.to_dict(),
        publish_interval=publish_interval,
    )
    router.on(ReportKind.SNAPSHOT_LAYOUT, book.on_layout)
    router.on(ReportKind.SNAPSHOT, book.on_snapshot)
    router.on(ReportKind.MEMORY_RESTORE, book.on_restore)
    return book


def buddy_ranks(nodes: Sequence[str | None]) -> list[int | None]:
    """For each rank, the rank that keeps a copy of its snapshots: one on another node (a
    one-node cluster: another process), the least burdened so far, nearest in rank order after
    it; None for a world of one."""
    world = len(nodes)
    if world < 2:
        return [None] * world
    burden = [0] * world
    buddies: list[int | None] = []
    for rank in range(world):
        others = [(rank + offset) % world for offset in range(1, world)]
        elsewhere = [other for other in others if nodes[other] != nodes[rank] or nodes[rank] is None] or others
        buddy = min(elsewhere, key=lambda other: burden[other])  # min keeps the first of equals
        burden[buddy] += 1
        buddies.append(buddy)
    return buddies


def _spans_nodes(generation: _Generation) -> bool:
    return len({getattr(slot, "node_id", None) for slot in generation.slots}) > 1
