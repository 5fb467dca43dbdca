"""Peer-memory snapshots: a rank's state in host memory, with a copy on a rank of another node.

Runs on every rank. ``SnapshotStore`` lives as long as the actor (across generations): it holds
this rank's own snapshots and the copies it keeps for its peers, and answers the reads of ranks
restoring from memory. ``RankSnapshots`` is one generation's writer, called by the loop thread:

    snapshots.after_step(step, due=..., step_time_s=...)
                                   # when the commit vote said so: start the snapshot of ``step``
                                   # and return at once (on a GPU the copies are queued on a side
                                   # stream into pinned memory; on CPU the copier thread copies)
    ...                            # step + 1: data, forward, backward, gradient clip: the copy
                                   # to host memory, then to the buddy, runs meanwhile
    snapshots.wait_before_update() # (Trainer.train_step, before the commit vote of step + 1)
                                   # the snapshot is in host memory and with the buddy; it is
                                   # reported with what the loop waited for it (the copier
                                   # reported it held here as soon as it was, and the buddy
                                   # reports its copy)

Only the update of the next step waits: it is the first thing that changes the tensors being
copied (the optimizer step; forward and backward only read the parameters' shards). Its wait and
the stall of starting a snapshot are the snapshot's exposed cost, which the adaptive cadence
(``elastic/snapshot_cadence.py``) keeps under ``elastic.snapshot_overhead_limit``: with copies
shorter than a step's forward and backward it is near zero and snapshots run every step. (On a
CPU host the copier and the transfer to the buddy share the cores with the step: that shows in
the step time, not in this cost; ``bench/recovery.py --only snapshot_cost`` measures it.)

Why the wait comes before the commit vote and includes the copy to the buddy: once any rank
applies a step, every rank has voted on it, so every rank's snapshot before it is with its
buddy (the driver's book relies on it, ``orchestrator/driver/peer_memory.py``). Two host buffers
take turns (double buffering): a snapshot is copied into the buffer of the one before the
previous, whose store entry is dropped first, so the previous snapshot stays whole in the
store while the next one is copied. A store keeps the newest ``LABELS_KEPT`` snapshots, so the
older of the two is complete whenever the newer one is being made: a failure during a copy
always leaves a complete snapshot to use, and a snapshot enters the store only once its bytes
are all in host memory. Every snapshot has the generation's one layout, which restores read.

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
from dataclasses import dataclass
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
    """One generation's peer-memory snapshots of this rank (loop thread; a copier thread)."""

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
        """``while_copying(step)``: called by the copier as it copies the snapshot of ``step`` to
        the buddy (fault injection)."""
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
        # State on a GPU is copied on a stream of its own, beside the next step's kernels; state
        # in host memory (a CPU run, FSDP's CPU offload) by the copier thread.
        on_device = any(source.device.type == "cuda" for source in self._sources.values())
        self._stream = _side_stream(trainer.device) if on_device else None
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"meshpilot-snapshot-r{rank}")
        self._in_flight: _InFlight | None = None

    def after_step(self, step: int, *, due: bool, step_time_s: float) -> None:
        """Loop thread, after ``step`` was applied: when the commit vote said so (``due``), start
        the snapshot of it (to a host buffer, then to the buddy) and return; the next step's
        forward and backward run meanwhile."""
        if not due:
            return
        started = time.perf_counter()
        self.flush()  # normally done already: the previous copy was awaited before this step's update
        slot = self._turn
        self._turn = (self._turn + 1) % LABELS_KEPT
        if (old := self._keys[slot]) is not None:
            self.store.discard(old)  # no reader may see the bytes being overwritten
        buffer = self._buffers[slot]
        if buffer is None or buffer.layout.signature != self._layout.signature:
            from checkpointing.staging import HostBuffer

            buffer = self._buffers[slot] = HostBuffer(self._layout, pin_memory=self._pin)
        key = snapshot_key(self.generation, step, self.rank)
        self._keys[slot] = key
        copied_on_device = self._start_device_copy(buffer)
        stalled_s = time.perf_counter() - started
        future = self._copier.submit(self._copy, key, step, buffer, copied_on_device)
        self._in_flight = _InFlight(step=step, future=future, stalled_s=stalled_s, step_time_s=step_time_s)

    def wait_before_update(self) -> None:
        """Loop thread, in the step after a snapshot, before its commit vote and optimizer step
        (``Trainer.train_step``): the snapshot in flight must be in host memory, since the update
        changes the tensors it copies, and with its buddy, so that a step applied anywhere proves
        every rank's snapshot before it whole (see the module docstring)."""
        self.flush()

    def flush(self) -> None:
        """Loop thread: wait for the snapshot in flight, then report it with its exposed cost."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        started = time.perf_counter()
        copied = in_flight.future.result()  # a failure to reach the buddy was logged by the copier
        self._report(in_flight, copied, waited_s=time.perf_counter() - started)

    def close(self, *, wait: bool) -> None:
        """Leave the generation. Without ``wait``, a snapshot in flight finishes (or fails) on the
        copier and reports on its own."""
        if wait:
            self.flush()
        elif (in_flight := self._in_flight) is not None:
            self._in_flight = None
            in_flight.future.add_done_callback(
                lambda done: self._report(in_flight, not done.exception() and done.result(), waited_s=0.0)
            )
        self._copier.shutdown(wait=wait)

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

    def _start_device_copy(self, buffer: HostBuffer) -> Any:
        """Loop thread, state on a GPU: queue the copies to the pinned buffer on the side stream,
        after the step's update, and return the event that marks them done (None for state in
        host memory: the copier thread copies)."""
        if self._stream is None:
            return None
        import torch

        self._stream.wait_stream(torch.cuda.current_stream(self.trainer.device))  # after the update
        with torch.cuda.stream(self._stream):
            buffer.stage(self._sources, wait=False)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done

    def _copy(self, key: str, step: int, buffer: HostBuffer, copied_on_device: Any) -> bool:
        """Copier thread: the snapshot into host memory (on CPU the copy itself; on a GPU the wait
        for the side stream), held in the store, then handed to the buddy. Returns whether the
        buddy holds it."""
        if copied_on_device is None:
            buffer.stage(self._sources)
        else:
            copied_on_device.synchronize()
        data = buffer.memoryview()
        self.store.put(key, (self.generation, step), data)
        # Held here now: the driver counts on it at once, without waiting for a buddy that may be
        # the rank just lost (its copy, and this rank's report with the cost, come after).
        self.channel.send(SnapshotReport(self.rank, time.time(), self.generation, step, copied=False))
        self._while_copying(step)
        return self._copy_to_buddy(key, step, data)

    def _copy_to_buddy(self, key: str, step: int, data: memoryview) -> bool:
        """Copier thread: hand the snapshot to the buddy and wait for it to be held there."""
        import numpy as np
        import ray

        if self.plan.buddy is None:
            return False
        try:
            payload = np.frombuffer(data, np.uint8)
            ray.get(
                self.plan.buddy.keep_snapshot.remote(key, self.generation, step, self.rank, payload),
                timeout=PEER_CALL_TIMEOUT_S,
            )
            return True
        except Exception as error:  # noqa: BLE001 - the buddy is gone: the own copy still counts
            buddy = self.plan.buddy_rank
            log.warning("rank %d: snapshot of step %d not copied to rank %s: %s", self.rank, step, buddy, error)
            return False

    def _report(self, in_flight: _InFlight, copied: bool, *, waited_s: float) -> None:
        """The snapshot is in this rank's memory (and the buddy's when ``copied``); what it cost
        the loop, in steps: the stall starting it and the wait for it before the next update."""
        self.channel.send(
            SnapshotReport(
                rank=self.rank,
                time=time.time(),
                generation=self.generation,
                step=in_flight.step,
                copied=copied,
                cost_steps=(in_flight.stalled_s + waited_s) / max(in_flight.step_time_s, 1e-6),
            )
        )


@dataclass
class _InFlight:
    """A snapshot the copier is working on: its step, the copier's answer (whether the buddy holds
    it) and what it cost the loop thread so far."""

    step: int
    future: Future[bool]
    stalled_s: float  # starting it (a buffer allocated, the copies queued)
    step_time_s: float  # of the step it snapshots: the unit of its cost


def _side_stream(device: Any) -> Any:
    """A CUDA stream of ``device`` for the snapshot copies, so they overlap the next step's kernels."""
    import torch

    return torch.cuda.Stream(device=device)


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
