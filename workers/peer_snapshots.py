"""Peer-memory snapshots: a rank's state in host memory, with a copy on a rank of another node.

Runs on every rank. ``SnapshotStore`` lives as long as the actor (across generations): it holds
this rank's own snapshots and the copies it keeps for its peers, and answers the reads of ranks
restoring from memory. ``RankSnapshots`` is one generation's writer, called by the loop thread:

    snapshots.before_step()        # waits for the previous snapshot's copy to reach the buddy
    snapshots.after_step(step, due=..., step_time_s=...)
                                   # when the commit vote said so: copy the slices to a host
                                   # buffer (the only stall), send the copy to the buddy in the
                                   # background, report what it cost

Why a step waits for the previous copy: once any rank completes a step, every rank has entered
it (the commit vote), so every rank's copy of the snapshot before it is with its buddy. A store
keeps the newest ``LABELS_KEPT`` snapshots, so the older of the two is complete whenever the
newer one is being made: a failure during a copy always leaves a complete snapshot to use.

``PeerMemory`` is the reader's storage backend over the snapshots: byte ranges come from this
process's store when it holds the object, else from its holders, owner first, by actor call.
The slices are the checkpoint writer's (``checkpointing.staging``: the same layout, the same
deduplication), so ``checkpointing.reader`` reshards a snapshot to any mesh as it does a
checkpoint.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from checkpointing.errors import CheckpointError
from workers.reporting import ReportChannel
from workers.spec.messages import MemoryRestoreReport, SnapshotLayoutReport, SnapshotPlan, SnapshotReport, StartFrom

if TYPE_CHECKING:  # torch: the driver imports this module (keys, store) and must not load it
    from checkpointing.staging import HostBuffer, Layout
    from workers.trainer import Trainer

log = logging.getLogger("meshpilot.rank")

# Snapshots a store keeps (own and held alike): the newest, and the complete one before it.
LABELS_KEPT = 2
# A copy to the buddy or a read from a peer that takes longer than this is given up.
PEER_CALL_TIMEOUT_S = 120.0

Label = tuple[int, int]  # (generation, step)


def snapshot_key(generation: int, step: int, rank: int) -> str:
    """The object name of rank ``rank``'s snapshot of ``step`` in ``generation``."""
    return f"memory/g{generation:06d}/step-{step:08d}/rank-{rank:05d}"


class SnapshotMissingError(CheckpointError):
    """No holder answered for a snapshot object: the restore cannot come from memory."""

    failure_kind = "storage"


class StaleSnapshotError(RuntimeError):
    """A snapshot copy from a generation older than the holder's: its sender was cut off (a
    partition) while the job moved on; what it sends must not count, nor displace newer copies."""


class SnapshotMemoryError(CheckpointError):
    """The snapshots would take more host memory than ``elastic.snapshot_memory_limit_mb``."""


class SnapshotStore:
    """Snapshot objects in this process's memory, by key (thread-safe; one per actor)."""

    def __init__(self, labels_kept: int = LABELS_KEPT) -> None:
        self._labels_kept = labels_kept
        self._objects: dict[str, tuple[Label, memoryview]] = {}
        self._lock = threading.Lock()

    def put(self, key: str, label: Label, data: memoryview | bytes) -> None:
        """Keep ``data`` under ``key``; objects of labels older than the newest kept are dropped."""
        with self._lock:
            self._objects[key] = (label, memoryview(data).cast("B"))
            newest = sorted({held for held, _ in self._objects.values()})[-self._labels_kept :]
            self._objects = {k: v for k, v in self._objects.items() if v[0] in newest}

    def discard(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._objects

    def read(self, key: str, start: int, end: int) -> bytes:
        with self._lock:
            found = self._objects.get(key)
        if found is None:
            raise SnapshotMissingError(f"peer-memory snapshot {key} is not held here")
        return bytes(found[1][start:end])

    def nbytes(self) -> int:
        with self._lock:
            return sum(len(data) for _, data in self._objects.values())


class RankSnapshots:
    """One generation's peer-memory snapshots of this rank (loop thread; a sender thread)."""

    def __init__(
        self,
        trainer: Trainer,
        plan: SnapshotPlan,
        store: SnapshotStore,
        channel: ReportChannel,
        *,
        generation: int,
        while_copying: Callable[[int], None] = lambda step: None,
    ) -> None:
        """``while_copying(step)``: called by the sender as it copies the snapshot of ``step`` (fault injection)."""
        from checkpointing.staging import Placement, local_data, plan_layout
        from workers.checkpoints import owns_plain_tensors

        self.trainer = trainer
        self.plan = plan
        self.store = store
        self.rank = rank = channel.rank
        self.generation = generation
        self.channel = channel
        self._owns_plain = owns_plain_tensors(trainer)
        self._placement = Placement.of(trainer.world_mesh)
        self._pin = trainer.device.type == "cuda"
        self._buffers: list[HostBuffer | None] = [None] * LABELS_KEPT
        self._keys: list[str | None] = [None] * LABELS_KEPT
        self._turn = 0
        # The optimizer state exists before the first step (allocated as that step would), so
        # the layout, and with it the memory needed, is known now.
        trainer.ensure_optimizer_state()
        state = trainer.checkpoint_state()
        self._layout = plan_layout(state, rank=rank, owns_plain_tensors=self._owns_plain, placement=self._placement)
        # The tensors (and their local shards) are the same objects every step: the optimizer
        # updates them in place. Looked up once, each snapshot is only the copies.
        self._sources = {fqn: local_data(value).detach() for fqn, value in state.items()}
        _check_memory(self._layout.size, plan.memory_limit_bytes)
        self._send_layout(self._layout)
        self._while_copying = while_copying
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"meshpilot-snapshot-r{rank}")
        self._in_flight: Future | None = None
        self._waited_s = 0.0  # the loop thread's waits for copies in flight since the last snapshot

    def before_step(self) -> None:
        """Loop thread, before a step: the previous snapshot's copy must have reached the buddy."""
        self.flush()

    def after_step(self, step: int, *, due: bool, step_time_s: float) -> None:
        """Loop thread, after ``step`` was applied: snapshot it when the commit vote said so
        (``due``; the loop waits only for the copy to host memory)."""
        if not due:
            return
        started = time.perf_counter()
        self.flush()
        layout = self._layout
        slot = self._turn
        self._turn = (self._turn + 1) % LABELS_KEPT
        if (old := self._keys[slot]) is not None:
            self.store.discard(old)  # no reader may see the bytes being overwritten
        buffer = self._buffers[slot]
        if buffer is None or buffer.layout.signature != layout.signature:
            from checkpointing.staging import HostBuffer

            buffer = self._buffers[slot] = HostBuffer(layout, pin_memory=self._pin)
        buffer.stage(self._sources)
        key = snapshot_key(self.generation, step, self.rank)
        self._keys[slot] = key
        data = buffer.memoryview()
        self.store.put(key, (self.generation, step), data)
        stalled_s, self._waited_s = self._waited_s + time.perf_counter() - started, 0.0
        self._in_flight = self._sender.submit(self._copy_to_buddy, key, step, data, stalled_s, step_time_s)

    def flush(self) -> None:
        """Wait for the copy in flight (its failure was reported and logged by the sender)."""
        if self._in_flight is not None:
            started = time.perf_counter()
            self._in_flight.result()
            self._in_flight = None
            self._waited_s += time.perf_counter() - started

    def close(self, *, wait: bool) -> None:
        if wait:
            self.flush()
        self._sender.shutdown(wait=wait)

    def _send_layout(self, layout: Layout) -> None:
        from checkpointing.spec import ChunkEntry

        chunks = tuple(
            ChunkEntry(
                fqn=slot.fqn,
                offsets=slot.offsets,
                sizes=slot.sizes,
                key="",
                start=slot.begin,
                end=slot.end,
                block_rows=slot.block_rows,
                checksums=(),
            )
            for slot in layout.slots
        )
        self.channel.send(
            SnapshotLayoutReport(
                rank=self.rank,
                time=time.time(),
                generation=self.generation,
                buddy_rank=self.plan.buddy_rank,
                bytes=layout.size,
                tensors=layout.tensors,
                chunks=chunks,
            )
        )

    def _copy_to_buddy(self, key: str, step: int, data: memoryview, stalled_s: float, step_time_s: float) -> None:
        """Sender thread: hand the snapshot to the buddy, wait for it to be held there, and report
        it with its cost in steps: ``stalled_s`` of the loop thread, and the CPU this thread and
        the buddy spent on the copy (the ranks share their hosts' cores with it)."""
        import numpy as np
        import ray

        cpu_started = time.thread_time()
        copied, buddy_cpu_s = False, 0.0
        self._while_copying(step)
        if self.plan.buddy is not None:
            try:
                payload = np.frombuffer(data, np.uint8)
                buddy_cpu_s = ray.get(
                    self.plan.buddy.keep_snapshot.remote(key, self.generation, step, self.rank, payload),
                    timeout=PEER_CALL_TIMEOUT_S,
                )
                copied = True
            except Exception as error:  # noqa: BLE001 - the buddy is gone: the own copy still counts
                buddy = self.plan.buddy_rank
                log.warning("rank %d: snapshot of step %d not copied to rank %s: %s", self.rank, step, buddy, error)
        cost_s = stalled_s + time.thread_time() - cpu_started + buddy_cpu_s
        self.channel.send(
            SnapshotReport(
                rank=self.rank,
                time=time.time(),
                generation=self.generation,
                step=step,
                copied=copied,
                cost_steps=cost_s / max(step_time_s, 1e-6),
            )
        )


def _check_memory(snapshot_bytes: int, limit_bytes: int | None) -> None:
    """Refuse a layout whose snapshots do not fit the configured host memory: a rank keeps two
    snapshots of its own state and two of its buddy's (about the same size)."""
    needed = LABELS_KEPT * 2 * snapshot_bytes
    if limit_bytes is not None and needed > limit_bytes:
        raise SnapshotMemoryError(
            f"peer-memory snapshots need {needed / 2**20:.1f} MiB of host memory per rank ({LABELS_KEPT} snapshots "
            f"of this rank's {snapshot_bytes / 2**20:.1f} MiB of state and {LABELS_KEPT} of its buddy's), over "
            f"elastic.snapshot_memory_limit_mb={limit_bytes / 2**20:g}: raise the limit, shard the state over more "
            "ranks, or set elastic.snapshot_interval_steps=0 to turn snapshots off"
        )


class PeerMemory:
    """The reader's storage over peer-memory snapshots (``checkpointing.reader`` calls ``get_range``)."""

    uri = "peer-memory"

    def __init__(self, holders: dict[str, tuple[Any, ...]], local: SnapshotStore) -> None:
        self.holders = holders
        self.local = local
        self.bytes_local = 0
        self.bytes_remote = 0
        self._lock = threading.Lock()

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if self.local.holds(key):
            data = self.local.read(key, start, end)
            with self._lock:
                self.bytes_local += len(data)
            return data
        import ray

        errors = []
        for holder in self.holders.get(key, ()):
            try:
                data = ray.get(holder.read_snapshot.remote(key, start, end), timeout=PEER_CALL_TIMEOUT_S)
            except Exception as error:  # noqa: BLE001 - try the next holder
                errors.append(f"{type(error).__name__}: {str(error)[:200]}")
                continue
            with self._lock:
                self.bytes_remote += len(data)
            return data
        raise SnapshotMissingError(
            f"peer-memory snapshot {key}: no holder answered ({'; '.join(errors) or 'none known'})"
        )


def restore_from_memory(trainer: Trainer, start: StartFrom, store: SnapshotStore, channel: ReportChannel) -> None:
    """Inside ``configure``: fill ``trainer`` with the peer-memory snapshot ``start.memory``
    describes, resharded to this mesh, and report the bytes read here and from peers."""
    from checkpointing.reader import read_into

    assert start.memory is not None, "a MEMORY start names its snapshot"
    started = time.perf_counter()
    trainer.ensure_optimizer_state()
    memory = PeerMemory(start.memory.holders, store)
    read_into(memory, start.memory.manifest, trainer.checkpoint_state(), verify=False)
    channel.send(
        MemoryRestoreReport(
            rank=channel.rank,
            time=time.time(),
            step=start.step,
            bytes_local=memory.bytes_local,
            bytes_remote=memory.bytes_remote,
            seconds=time.perf_counter() - started,
        )
    )
