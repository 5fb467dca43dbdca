"""Closing a process group's connections for certain, by the sockets it opened.

Runs on every rank. With gloo, destroying (even aborting) a process group does not close its
TCP connections while anything in C++ still holds the backend (FSDP2 and DeviceMesh
internals do), so peers blocked on this rank wait for the whole collective timeout. The rank
therefore notes which sockets appeared while it joined a generation and, when it leaves or
the driver aborts the generation, shuts them down: every peer blocked on it fails at once.
Linux only (/proc); elsewhere these are no-ops and the collective timeout applies.

gloo only: NCCL's own abort releases work blocked on a dead peer, and the sockets of an
NCCL group (its bootstrap and proxy connections) are NCCL's to close, so for any other
backend ``GroupSockets`` notes nothing and shuts nothing down.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

_FD_DIR = Path("/proc/self/fd")

# The backends whose process groups are closed for certain by shutting their sockets down.
SOCKET_SHUTDOWN_BACKENDS = frozenset({"gloo"})
# How long ``shutdown_sockets`` gives the owners of the sockets it shut for reading to close
# them (gloo's event loop wakes every 10 ms), and how often it looks.
SETTLE_S = 0.2
SETTLE_POLL_S = 0.005


class GroupSockets:
    """Rank side, around joining a generation: the sockets its process groups opened.

    ``watch = GroupSockets(backend)`` before ``init_process_group`` (and whatever builds the
    generation's sub-groups), ``watch.opened()`` after: the sockets to shut down when the
    rank leaves or the driver aborts the generation. Empty for a backend not in
    ``SOCKET_SHUTDOWN_BACKENDS``. ``before``: the sockets open at construction.
    """

    def __init__(self, backend: str) -> None:
        self.tracked = backend in SOCKET_SHUTDOWN_BACKENDS
        self.before = socket_inodes() if self.tracked else set()

    def opened(self) -> set[str]:
        """Sockets opened since construction (none when the backend's are not tracked)."""
        return socket_inodes() - self.before if self.tracked else set()


def socket_inodes() -> set[str]:
    """Identifiers of the sockets this process has open now."""
    if not _FD_DIR.is_dir():
        return set()
    found = set()
    for entry in _FD_DIR.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def shutdown_sockets(inodes: set[str], *, settle_s: float = SETTLE_S) -> int:
    """Shut every open socket among ``inodes`` down; returns how many (listeners are left alone).

    Reading first: the owner (gloo's event loop thread) reads the end of the connection, fails
    whatever waits on it and closes the socket, which tells the peer. The sockets still open
    after ``settle_s`` (an owner that is not reading) are then shut down for writing too, which
    tells their peers at once.

    Why not both directions at once: gloo (torch 2.13) parks a send whose write fails with
    EPIPE in the connection's transmit queue, and the connection's error never reaches the
    sends parked there: the collective waits for the whole collective timeout. With the write
    side shut down first, every send a collective issued before gloo read the end was parked
    so (a rank stuck in FSDP's reduce-scatter after the driver's abort, seen in CI). How often
    a release still leaves a rank stuck, against shutting both ways at once: ``bench/release.py``.
    """
    if not inodes or not _FD_DIR.is_dir():
        return 0
    shut = shutdown_open(inodes, socket.SHUT_RD)
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and shut & socket_inodes():
        time.sleep(SETTLE_POLL_S)
    shutdown_open(shut, socket.SHUT_RDWR)
    return len(shut)


def shutdown_open(inodes: set[str], how: int) -> set[str]:
    """``socket.shutdown(how)`` on every open socket among ``inodes`` but listeners; returns those.

    ``shutdown_sockets`` is the order a release uses (reading first, then both ways);
    bench/release.py calls this directly for the flow it measures against (both ways at once)."""
    shut = set()
    for entry in _FD_DIR.iterdir():
        try:
            target = os.readlink(entry)
            if target not in inodes:
                continue
            duplicate = os.dup(int(entry.name))
        except (OSError, ValueError):
            continue
        try:
            with socket.socket(fileno=duplicate) as sock:
                # Leave listeners alone: gloo's accept thread treats a dead listener as fatal.
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                sock.shutdown(how)
                shut.add(target)
        except OSError:
            pass  # already shut down, or not connected
    return shut
