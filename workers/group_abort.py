"""Aborting a generation's process groups on a rank, and making sure the abort took.

Runs on every rank: ``release_collectives`` on the control thread that answers the driver's
``abort_collectives``, ``abort_groups`` on the loop thread as it leaves a generation;
``watch_abort`` starts a timer thread after the driver's abort.

The driver's abort shuts the generation's sockets down (``workers/sockets.py``) with gloo, or
aborts the groups with any other backend: the collective the loop is blocked in fails at once,
well under a second. It does not abort gloo groups while the loop may still run: the shut
sockets alone fail every collective, those queued and those enqueued after
(``tests/integration/test_gloo_release.py``); the loop aborts them as it leaves. A few times in
many CI runs (never alone) a survivor's gloo collective stayed blocked through the driver's
whole unwind window, and the driver had to count the survivor's replica group as hit. Traced: a
send that gloo parked when its write failed on a socket already shut for writing, which the
connection's error never reaches (the sockets are now shut for reading first; a send that meets
a peer's closed socket can still be parked so, until the collective timeout). So, once
``CHECK_AFTER_S`` has passed with the loop still in the aborted generation, the watch releases
them again (a release that raced something still being set up) and logs what names the cause:
how many of the groups' sockets gloo has still not closed, the sockets opened since the rank
joined that no group noted, and every Python thread's stack.
"""

from __future__ import annotations

import logging
import sys
import threading
import traceback
from collections.abc import Callable

from workers.sockets import SOCKET_SHUTDOWN_BACKENDS, shutdown_sockets, socket_inodes

log = logging.getLogger("meshpilot.rank")

# Long enough for a healthy unwind (well under a second), short enough to act before the
# driver's unwind window (elastic.hang_timeout_s, at least 8 s in the tests) ends.
CHECK_AFTER_S = 4.0


def release_collectives(sockets: set[str], backend: str) -> None:
    """Make every collective of the generation fail at once, while the loop may still be in one
    or enter one: gloo's ``sockets`` (noted when the rank joined) are shut down; with any other
    backend the groups are aborted (see the module docstring)."""
    if backend in SOCKET_SHUTDOWN_BACKENDS:
        shutdown_sockets(sockets)
    else:
        abort_groups(set())


def abort_groups(sockets: set[str]) -> None:
    """Once the loop is out of the generation: shut ``sockets`` (the generation's, noted when
    the rank joined it) down, then abort every process group of this process; errors of groups
    already aborted are logged, not raised."""
    import torch.distributed as dist

    from checkpointing.torch_compat import abort_process_groups

    # The loop is out: no send of this rank is in flight to be parked, so no reading first.
    shutdown_sockets(sockets, settle_s=0.0)
    if dist.is_initialized():
        try:
            abort_process_groups()
        except Exception as error:  # noqa: BLE001 - already aborted, or a backend without abort
            log.debug("abort of process groups: %s", error)


def watch_abort(
    *,
    rank: int,
    generation: int,
    still_in: Callable[[], bool],
    sockets: set[str],
    before_join: set[str],
    backend: str,
    after_s: float = CHECK_AFTER_S,
) -> threading.Timer:
    """Check once, ``after_s`` from now, that the loop left ``generation`` (``still_in()`` is
    False); if not, release its collectives again and log why it may be stuck (see the module
    docstring)."""

    def check() -> None:
        if not still_in():
            return
        open_now = socket_inodes()
        release_collectives(sockets, backend)
        # Sockets are noted for gloo only (an NCCL group's are NCCL's to close): say nothing of them otherwise.
        noted = (
            f" {len(sockets & open_now)} of its groups' {len(sockets)} sockets still open, "
            f"{len(open_now - before_join - sockets)} sockets opened since it joined not noted as its groups'."
            if before_join
            else ""
        )
        log.warning(
            "rank %d still in generation %d %g s after its abort; aborted again.%s Its threads:\n%s",
            rank,
            generation,
            after_s,
            noted,
            thread_stacks(),
        )

    timer = threading.Timer(after_s, check)
    timer.daemon = True
    timer.start()
    return timer


def thread_stacks() -> str:
    """Every Python thread's stack, innermost call last, headed by the thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )
