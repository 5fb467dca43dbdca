"""The device a rank trains on, and the marker that says when its loop waits for peers.

Runs on every rank (actor or torchrun script). Two small objects:

- ``RankDevice`` wraps the torch device with the few things the step and the generation
  change ask of it: ``sync()`` (wait until the device has run everything queued so far) and
  ``empty_cache()`` (hand cached blocks back between generations; ``settle()`` does both as a
  rank leaves a generation). On CUDA they call
  ``torch.cuda``; on the CPU (gloo) every collective already blocks the calling thread, so
  they do nothing, but they are still called in the same places, so a test that watches them
  (a subclass passed to the Trainer) sees the order a GPU run would follow.
- ``PeerWaitMarker`` records, per thread, that the thread is waiting for its peers (a device
  sync, the commit vote, a ``.item()``), so hang blame reads a fact instead of guessing from
  the innermost Python frame: a rank waiting on the GPU sits in ``.item()``, not in
  ``torch/distributed``.

torch is imported inside the methods: the driver imports ``workers.actor`` (which imports
this module) for the class handle only, and never loads torch.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only: torch is imported where it is used, on the rank
    import torch

log = logging.getLogger("meshpilot.rank")


class RankDevice:
    """The torch device of one rank. ``torch_device`` is what tensors are moved to."""

    def __init__(self, torch_device: torch.device) -> None:
        self.torch_device = torch_device

    @classmethod
    def of(cls, device: torch.device | RankDevice) -> RankDevice:
        """``device`` itself if it is a RankDevice already, else one wrapping the torch device."""
        return device if isinstance(device, RankDevice) else cls(device)

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def sync(self) -> None:
        """Return once the device has run everything queued on it (CUDA); a no-op on the CPU.

        NCCL only enqueues collectives; gloo runs them on the calling thread, so on the CPU
        everything queued has already run when this is called.
        """
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.torch_device)

    def empty_cache(self) -> None:
        """Hand the caching allocator's unused blocks back (CUDA), so that a new generation's
        communicators, allocated outside torch's allocator, find the memory; a no-op on the CPU."""
        if self.is_cuda:
            import torch

            torch.cuda.empty_cache()

    def settle(self, context: str) -> None:
        """After a rank's process groups are aborted: wait for the device, then empty its cache.
        An aborted NCCL communicator may leave a CUDA error behind for the sync to raise; by then
        the rank has left its generation, so the error changes nothing and is only logged."""
        for step in (self.sync, self.empty_cache):
            try:
                step()
            except Exception as error:  # noqa: BLE001 - an aborted NCCL context may raise here
                log.debug("device %s %s: %s", step.__name__, context, error)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.torch_device})"


class PeerWait(StrEnum):
    """What a rank's loop thread is waiting for, while it waits on its peers."""

    DEVICE_SYNC = "device sync"  # the step's gradient reductions (NCCL) finishing on the device
    COMMIT_VOTE = "commit vote"  # every rank's vote on the step, through the store
    RESULT_READ = "result read"  # .item(): the device finishing the step so a value can be read


class PeerWaitMarker:
    """Per thread: what the thread is waiting for on its peers now, if anything.

    Set by the loop thread (``with marker.waiting(PeerWait.COMMIT_VOTE): ...``), read by the
    actor's control thread when it answers a poll. One marker lives as long as the rank.
    """

    def __init__(self) -> None:
        self._waits: dict[int, PeerWait] = {}

    @contextmanager
    def waiting(self, what: PeerWait) -> Iterator[None]:
        """The calling thread waits for its peers inside the block (nested blocks restore the outer one)."""
        thread = threading.get_ident()
        outer = self._waits.get(thread)
        self._waits[thread] = what
        try:
            yield
        finally:
            if outer is None:
                self._waits.pop(thread, None)
            else:
                self._waits[thread] = outer

    def of(self, thread: int) -> PeerWait | None:
        """What thread ``thread`` waits for now; None when it is not marked as waiting."""
        return self._waits.get(thread)

    def position(self, thread: int | None) -> tuple[bool | None, str | None]:
        """Control thread: where the loop thread ``thread`` is now, as (waiting on peers?, where).

        The trainer's mark comes first (a device sync, the commit vote, a ``.item()``): on a
        GPU a rank waiting for its peers sits in those, not in ``torch/distributed``. Without
        a mark, the innermost frame decides: a collective or the store's vote is waiting.
        ``where`` is the innermost frame as file:line, after the mark's name when marked.
        """
        frame = sys._current_frames().get(thread) if thread else None
        if thread is None or frame is None:
            return None, None
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        marked = self.of(thread)
        if marked is not None:
            return True, f"{marked} ({where})"
        path = frame.f_code.co_filename.replace(os.sep, "/")
        waiting = "torch/distributed/" in path or path.endswith("workers/rendezvous.py")
        return waiting, where
