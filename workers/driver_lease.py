"""The lease that bounds how long a rank actor (and the rendezvous store) outlives its driver.

Runs in the rank actors and in the ``StoreHost`` actor, with ``runtime.survive_driver_loss``:
they are detached Ray actors then, which Ray keeps alive after the driver's process is gone, so
that a new driver can adopt them (``orchestrator/driver/adoption.py``). Each holds a
``DriverLease`` that every call from a driver renews (the ranks' polls, the driver's lease
renewals twice a second); a ``LeaseWatch`` thread looks at it twice a second:

    silent   no driver heard for ``silence_s``: the store asks the generation to pause at the next
             step boundary (the commit vote's pause), so the ranks finish the step in flight and
             wait there, holding their state, instead of running on without a driver to commit
             their checkpoints and take their reports;
    expired  no driver heard for ``lease_s``: the process exits and Ray removes its actor, so
             nothing outlives a driver that never comes back.

Without the option nothing here runs: the actors die with the driver, as Ray's non-detached
actors do.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from enum import StrEnum

log = logging.getLogger("meshpilot.rank")

# How often the watch thread looks at the lease (seconds).
WATCH_INTERVAL_S = 0.5
# The longest a store waits without a driver before it pauses the generation: the driver renews
# twice a second from its own thread, so four missed renewals mean the driver is gone, not busy.
# Until then the ranks go on committing steps by their vote (the new driver gets their reports and
# commits their checkpoints' manifests); a run that goes no further keeps that window short.
MAX_SILENCE_S = 2.0


def silence_for(lease_s: float) -> float:
    """Seconds without a driver after which the generation pauses: well within the lease."""
    return min(MAX_SILENCE_S, lease_s / 2)


class LeaseEvent(StrEnum):
    """What a look at the lease found (``LeaseWatch.check``)."""

    SILENT = "silent"  # once per silence: no driver for ``silence_s``
    EXPIRED = "expired"  # no driver for ``lease_s``: the holder exits


class DriverLease:
    """When a driver was last heard from (monotonic clock); renewed by every driver call."""

    def __init__(self, lease_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._last = clock()

    def renew(self) -> None:
        """A driver called: the lease runs ``lease_s`` from now."""
        self._last = self.clock()

    def silent_for(self) -> float:
        """Seconds since a driver was last heard from."""
        return self.clock() - self._last


class LeaseWatch:
    """Turns a lease's silence into at most one ``SILENT`` per silence and one ``EXPIRED``."""

    def __init__(self, lease: DriverLease, *, silence_s: float) -> None:
        self.lease = lease
        self.silence_s = silence_s
        self._silent_noted = False
        self.expired = False

    def check(self) -> LeaseEvent | None:
        """One look at the lease (the watch thread's, or a test's with a fake clock)."""
        if self.expired:
            return None
        silent_for = self.lease.silent_for()
        if silent_for > self.lease.lease_s:
            self.expired = True
            return LeaseEvent.EXPIRED
        if silent_for <= self.silence_s:
            self._silent_noted = False  # a driver came back: the next silence is noted anew
            return None
        if self._silent_noted:
            return None
        self._silent_noted = True
        return LeaseEvent.SILENT


def exit_process(holder: str, lease_s: float) -> None:
    """The lease ran out: end this process (its detached actor with it), whatever its threads do."""
    log.warning("%s: no driver for %g s (runtime.driver_lease_s): exiting", holder, lease_s)
    logging.shutdown()
    os._exit(0)  # a blocked loop thread must not keep the process (and its GPU) alive


def start_watch(
    lease: DriverLease,
    *,
    holder: str,
    on_silence: Callable[[], None] = lambda: None,
    on_expiry: Callable[[], None] | None = None,
    interval_s: float = WATCH_INTERVAL_S,
) -> threading.Thread:
    """Start the daemon thread watching ``lease`` (in a rank actor or the store's actor): it calls
    ``on_silence`` once per silence and ``on_expiry`` (default: exit the process) once."""
    watch = LeaseWatch(lease, silence_s=silence_for(lease.lease_s))
    expire = on_expiry if on_expiry is not None else (lambda: exit_process(holder, lease.lease_s))

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            event = watch.check()
            if event == LeaseEvent.SILENT:
                # A rank's warning reaches the next driver with its reports: the gap is in its record.
                log.warning("%s: no driver for %g s (the ranks pause at the next step)", holder, watch.silence_s)
                on_silence()
            elif event == LeaseEvent.EXPIRED:
                expire()
                return

    thread = threading.Thread(target=loop, name=f"driver-lease-{holder}", daemon=True)
    thread.start()
    return thread
