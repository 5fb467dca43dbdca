"""The rank-side abort of a generation: sockets shut down at once, and a loop still in the
aborted generation a few seconds later is aborted again and explained in the rank's log."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from workers.group_abort import abort_groups, watch_abort
from workers.sockets import SETTLE_S, shutdown_sockets, socket_inodes

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="sockets are found through /proc")


@needs_proc
def test_abort_releases_a_reader_blocked_on_a_group_socket():
    before = socket_inodes()
    left, right = socket.socketpair()  # stands for a connection of a process group
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(left.recv(1)))
    try:
        reader.start()
        abort_groups(socket_inodes() - before)
        reader.join(timeout=5)
        assert not reader.is_alive() and received == [b""]
    finally:
        left.close()
        right.close()


@needs_proc
def test_the_owner_reads_the_end_first_and_can_still_send_then_its_close_tells_the_peer():
    """gloo parks a send that fails with EPIPE where the connection's error never reaches it:
    the owner of a shut socket must read the end of it while its sends still go through."""
    ours, peer = socket.socketpair()  # only ours stands for a connection of a process group
    seen: list[bytes] = []

    def owner() -> None:  # stands for gloo's event loop: on the end of the connection, close it
        seen.append(ours.recv(1))
        seen.append(b"sent" if ours.send(b"x") == 1 else b"")
        ours.close()

    reading = threading.Thread(target=owner)
    try:
        reading.start()
        started = time.monotonic()
        assert shutdown_sockets({inode_of(ours)}) == 1
        reading.join(timeout=5)
        assert seen == [b"", b"sent"]
        assert time.monotonic() - started < SETTLE_S  # the owner's close ended the wait
        assert peer.recv(1) == b"x" and peer.recv(1) == b""
    finally:
        peer.close()


@needs_proc
def test_a_socket_nobody_reads_is_shut_for_writing_after_the_settle_time():
    ours, peer = socket.socketpair()
    try:
        shutdown_sockets({inode_of(ours)}, settle_s=0.05)
        assert peer.recv(1) == b""  # the peer is told at once, though nothing read our end
    finally:
        ours.close()
        peer.close()


def inode_of(sock: socket.socket) -> str:
    return os.readlink(f"/proc/self/fd/{sock.fileno()}")


@pytest.mark.parametrize("still_in", [True, False])
def test_a_loop_still_in_the_aborted_generation_is_aborted_again_and_explained(caplog, still_in: bool):
    sockets = {"socket:[1]", "socket:[2]"}
    with caplog.at_level(logging.WARNING, logger="meshpilot.rank"):
        timer = watch_abort(
            rank=3,
            generation=7,
            still_in=lambda: still_in,
            sockets=sockets,
            before_join={"socket:[0]"},
            backend="gloo",
            after_s=0.01,
        )
        timer.join(timeout=5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not still_in:
        assert warnings == []
        return
    [warning] = warnings
    assert warning.startswith("rank 3 still in generation 7 0.01 s after its abort; aborted again.")
    assert "0 of its groups' 2 sockets still open" in warning
    assert f"thread {threading.current_thread().name}:" in warning and "test_group_abort.py" in warning
