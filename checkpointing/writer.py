"""``CheckpointWriter``: the rank side of a save — stage to host, return, upload in the background.

Runs on every rank; each rank owns one writer. Call sequence (every rank, every save)::

    writer = CheckpointWriter(storage, rank=rank, report=send_to_driver, pin_memory=on_gpu,
                              max_in_flight=cfg.max_in_flight)
    stall_s = writer.save(step, state, extra=extra, owns_plain_tensors=first_rank_of_stage)
    ...                                             # training goes on while the upload runs
    writer.save_sync(step, state, extra=..., owns_plain_tensors=...)   # drains: durable on return
    writer.close()

``save`` copies this rank's slices into a reusable host buffer (the only stall), queues the
upload and returns the stall in seconds. A background thread computes block checksums while it
streams the buffer as one safetensors object (multipart, no temporary file), retries a failed
upload with backoff, and finally calls ``report`` with a ``ShardReport`` (frozen, ``checkpointing/spec.py``)
once the object is durable, or a ``FailureReport``. It never commits anything and never raises into training:
the driver's ``CommitCoordinator`` commits a step when all world_size reports are in. Every rank
reports for every save, with no files when it owns no slice.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from checkpointing.errors import CheckpointError
from checkpointing.spec import CHECKSUM_ALGORITHM, ChunkEntry, FailureReport, FileEntry, ShardReport, step_prefix
from checkpointing.staging import HostBuffer, Layout, LayoutCache, Placement
from checkpointing.storage import StorageBackend

log = logging.getLogger(__name__)


@dataclass
class _Job:
    step: int
    buffer: HostBuffer | None
    layout: Layout
    extra: dict[str, Any]
    stall_s: float
    done: threading.Event
    outcome: ShardReport | FailureReport | None = None


class CheckpointWriter:
    """Asynchronous, deduplicated, streaming writer of this rank's checkpoint shards."""

    def __init__(
        self,
        storage: StorageBackend,
        *,
        rank: int,
        report: Callable[[ShardReport | FailureReport], None],
        pin_memory: bool = False,
        max_in_flight: int = 1,
        upload_attempts: int = 3,
        retry_backoff_s: float = 1.0,
        mesh=None,
        stage_dims: tuple[str, ...] = ("pp",),
    ) -> None:
        """``mesh``: the job's global DeviceMesh (named dims), so that DTensors living on a
        sub-mesh (e.g. FSDP over dp_shard only) are written by one of their copies; without it
        each copy is uploaded and the coordinator keeps one."""
        if max_in_flight < 1:
            raise CheckpointError(f"checkpoint.max_in_flight must be >= 1, got {max_in_flight}")
        self.storage = storage
        self.rank = rank
        self._report = report
        self._pin_memory = bool(pin_memory and torch.cuda.is_available())
        self._max_in_flight = max_in_flight
        self._attempts = max(1, upload_attempts)
        self._backoff_s = retry_backoff_s
        self._placement = Placement.of(mesh, stage_dims=stage_dims) if mesh is not None else None
        self._layouts = LayoutCache()
        self._free: list[HostBuffer] = []  # host buffers ready for reuse
        self._pending = 0  # saves staged and not yet reported
        self._lock = threading.Condition()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._upload_loop, name=f"meshpilot-ckpt-upload-r{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    def save(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        *,
        extra: dict[str, Any] | None = None,
        owns_plain_tensors: bool,
    ) -> float:
        """Stage this rank's slices and queue their upload; return the loop stall in seconds.

        Blocks only to copy into host memory, and — back-pressure — while ``max_in_flight``
        earlier saves are still uploading. ``tensors`` maps FQN to a plain tensor or a DTensor;
        optimizer state goes in as ``optim.{fqn}.exp_avg`` / ``.exp_avg_sq`` / ``.step``.
        ``extra`` is JSON (data cursor, RNG, LR schedule) stored in the manifest from rank 0.
        """
        return self._enqueue(step, tensors, extra or {}, owns_plain_tensors).stall_s

    def save_sync(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        *,
        extra: dict[str, Any] | None = None,
        owns_plain_tensors: bool,
        timeout_s: float | None = None,
    ) -> float:
        """An emergency save: like ``save`` but returns only once this rank's shard is durable and reported.

        Returns the seconds the caller waited; raises ``CheckpointError`` when the upload failed
        (the failure is reported to the driver as well).
        """
        started = time.perf_counter()
        job = self._enqueue(step, tensors, extra or {}, owns_plain_tensors)
        if not job.done.wait(timeout_s):
            raise CheckpointError(
                f"step {step}: rank {self.rank}'s checkpoint upload did not finish within {timeout_s} s"
            )
        if isinstance(job.outcome, FailureReport):
            raise CheckpointError(f"step {step}: rank {self.rank}'s checkpoint upload failed: {job.outcome.error}")
        return time.perf_counter() - started

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until every queued save has been reported; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._lock.wait(left)
        return True

    def close(self, *, wait: bool = True) -> None:
        """Stop accepting saves; with ``wait`` (default) block until every queued upload is reported.

        With ``wait=False`` it returns at once and queued uploads finish on the (daemon) uploader thread.
        """
        if self._closed:
            return
        self._closed = True
        if wait:
            self.wait()
        self._queue.put(None)
        if wait:
            self._thread.join()

    # ----------------------------------------------------------------- staging
    def _enqueue(
        self, step: int, tensors: dict[str, torch.Tensor], extra: dict[str, Any], owns_plain_tensors: bool
    ) -> _Job:
        if self._closed:
            raise CheckpointError("this checkpoint writer is closed")
        try:
            json.dumps(extra, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise CheckpointError(
                f"checkpoint extra= must be plain JSON (numbers, strings, lists, dicts): {error}"
            ) from None
        started = time.perf_counter()
        layout = self._layouts.get(
            tensors, rank=self.rank, owns_plain_tensors=owns_plain_tensors, placement=self._placement
        )
        with self._lock:
            while self._pending >= self._max_in_flight:
                self._lock.wait()  # back-pressure: earlier saves still hold every buffer
            self._pending += 1
        buffer = None
        try:
            buffer = self._take_buffer(layout) if layout.slots else None
            if buffer is not None:
                buffer.stage(tensors)
        except BaseException:
            self._finish(buffer)
            raise
        # The report outlives this call and crosses threads: it holds its own copy of extra.
        job = _Job(
            step=step,
            buffer=buffer,
            layout=layout,
            extra=copy.deepcopy(extra),
            stall_s=time.perf_counter() - started,
            done=threading.Event(),
        )
        self._queue.put(job)
        return job

    def _take_buffer(self, layout: Layout) -> HostBuffer:
        """A free host buffer of the same layout, else a new one (the layout changed or none is free)."""
        with self._lock:
            reusable = next((b for b in self._free if b.layout.signature == layout.signature), None)
            if reusable is not None:
                self._free.remove(reusable)
                return reusable
            if len(self._free) >= self._max_in_flight:
                self._free.pop(0)  # resharded: drop a buffer of the old layout
        return HostBuffer(layout, pin_memory=self._pin_memory)

    def _finish(self, buffer: HostBuffer | None) -> None:
        with self._lock:
            if buffer is not None:
                self._free.append(buffer)
            self._pending -= 1
            self._lock.notify_all()

    # ------------------------------------------------------------------ upload
    def _upload_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job.outcome = self._upload_with_retries(job)
            except BaseException as error:  # noqa: BLE001 - never let the thread die silently
                job.outcome = FailureReport(step=job.step, rank=self.rank, error=_describe(error))
            self._deliver(job.outcome)
            self._finish(job.buffer)
            job.done.set()

    def _upload_with_retries(self, job: _Job) -> ShardReport | FailureReport:
        if job.buffer is None:
            return ShardReport(
                step=job.step, rank=self.rank, tensors=job.layout.tensors, stall_s=job.stall_s, extra=job.extra
            )
        error_text = ""
        for attempt in range(1, self._attempts + 1):
            started = time.perf_counter()
            try:
                files, chunks = self._upload(job)
            except Exception as error:  # noqa: BLE001 - retried, then given up and reported
                error_text = _describe(error)
                log.warning(
                    "rank %d: checkpoint upload of step %d failed (attempt %d of %d): %s",
                    self.rank,
                    job.step,
                    attempt,
                    self._attempts,
                    error_text,
                )
                if attempt < self._attempts:
                    time.sleep(self._backoff_s * 2 ** (attempt - 1))
                continue
            return ShardReport(
                step=job.step,
                rank=self.rank,
                files=files,
                tensors=job.layout.tensors,
                chunks=chunks,
                upload_s=time.perf_counter() - started,
                stall_s=job.stall_s,
                extra=job.extra,
            )
        return FailureReport(step=job.step, rank=self.rank, error=error_text, attempts=self._attempts)

    def _upload(self, job: _Job) -> tuple[tuple[FileEntry, ...], tuple[ChunkEntry, ...]]:
        assert job.buffer is not None, "a job without a buffer has nothing to upload (_upload_with_retries)"
        layout = job.layout
        key = f"{step_prefix(job.step)}rank-{self.rank:05d}-{secrets.token_hex(4)}.safetensors"
        digests: list[str] = []
        view = job.buffer.memoryview()
        size = self.storage.put_stream(
            key, _hashed_windows(view, layout, digests, self.storage.part_size), size=len(view)
        )
        if size != len(view):
            raise CheckpointError(f"{key}: stored {size} bytes of {len(view)}")
        header_checksum, block_sums = digests[0], iter(digests[1:])
        chunks = tuple(
            ChunkEntry(
                fqn=slot.fqn,
                offsets=slot.offsets,
                sizes=slot.sizes,
                key=key,
                start=slot.begin,
                end=slot.end,
                block_rows=slot.block_rows,
                checksums=tuple(next(block_sums) for _ in slot.blocks()),
            )
            for slot in layout.slots
        )
        file_entry = FileEntry(
            key=key, rank=self.rank, bytes=size, header_bytes=len(layout.header), header_checksum=header_checksum
        )
        return (file_entry,), chunks

    def _deliver(self, outcome: ShardReport | FailureReport) -> None:
        try:
            self._report(outcome)
        except Exception:  # the channel to the driver is the caller's; training must go on
            log.exception("rank %d: delivering the checkpoint report of step %s failed", self.rank, outcome.step)


def _hashed_windows(view: memoryview, layout: Layout, digests: list[str], part_size: int) -> Iterator[memoryview]:
    """Yield ``view`` in windows of whole parts, hashing every checksum block on the way.

    Hashing happens in the uploader's producer loop, one window ahead of the parts in flight, so
    it overlaps the network instead of adding a second pass. ``digests`` receives the header's
    checksum, then every block's, in file order.
    """
    blocks = [(0, len(layout.header))] + [block for slot in layout.slots for block in slot.blocks()]
    hashers = [hashlib.new(CHECKSUM_ALGORITHM) for _ in blocks]
    window = max(part_size, 1) * 4
    current = 0
    for start in range(0, len(view), window):
        stop = min(start + window, len(view))
        while current < len(blocks) and blocks[current][0] < stop:
            begin, end = blocks[current]
            hashers[current].update(view[max(begin, start) : min(end, stop)])
            if end > stop:
                break
            digests.append(f"{CHECKSUM_ALGORITHM}:{hashers[current].hexdigest()}")
            current += 1
        yield view[start:stop]
    while current < len(blocks):  # zero-length blocks at the very end
        digests.append(f"{CHECKSUM_ALGORITHM}:{hashers[current].hexdigest()}")
        current += 1


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
