"""The rank-side abort of a generation: sockets shut down at once, and a loop still in the
aborted generation a few seconds later is aborted again and explained in the rank's log."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import pytest

from workers.group_abort import abort_groups, watch_abort
from workers.sockets import socket_inodes

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


@pytest.mark.parametrize("still_in", [True, False])
def test_a_loop_still_in_the_aborted_generation_is_aborted_again_and_explained(caplog, still_in: bool):
    sockets = {"socket:[1]", "socket:[2]"}
    with caplog.at_level(logging.WARNING, logger="meshpilot.rank"):
        timer = watch_abort(
            rank=3, generation=7, still_in=lambda: still_in, sockets=sockets, before_join={"socket:[0]"}, after_s=0.01
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
