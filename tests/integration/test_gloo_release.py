"""The driver's abort on a gloo rank whose loop is still running: every collective of the
generation fails at once, those queued and the one it enqueues next included (two real processes, real gloo).

    python -m pytest tests/integration/test_gloo_release.py -q
"""

from __future__ import annotations

import datetime
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.ranks.spawned_ranks import rank_context
from workers.group_abort import release_collectives
from workers.sockets import GroupSockets

# How long the rank waits for its collectives to end: unreleased, they would wait for the
# collective timeout (120 s here).
WAIT_S = 10.0
QUEUED = 4


def _rank(rank: int, port: int, results: Any, done: Any) -> None:
    """One rank: join a 2-rank gloo world with a sub-group, run one collective; then rank 0
    enqueues collectives that rank 1 never joins, and the driver's abort releases them."""
    watch = GroupSockets("gloo")
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4), group=group)
    if rank == 1:  # alive, but not in the next collective: the peer that aborted and left
        done.wait(60)
        return
    # Collectives in flight and queued behind them (a group runs two at a time), as FSDP
    # enqueues them, when the driver's abort comes; then one enqueued after it.
    works = [dist.all_reduce(torch.ones(4), group=group, async_op=True) for _ in range(QUEUED)]
    release_collectives(watch.opened(), "gloo")
    works.append(dist.all_reduce(torch.ones(4), group=group, async_op=True))
    outcomes: list[str] = []

    def wait_all() -> None:
        for work in works:
            try:
                work.wait()
                outcomes.append("returned")
            except RuntimeError as error:
                outcomes.append(f"raised: {error}")

    thread = threading.Thread(target=wait_all, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    results.put(outcomes + ["still waiting"] * (len(works) - len(outcomes)))
    done.set()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="sockets are found through /proc")
def test_a_collective_enqueued_after_the_drivers_abort_fails_at_once():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)  # a free port
    context = rank_context()
    results, done = context.Queue(), context.Event()
    ranks = [context.Process(target=_rank, args=(rank, store.port, results, done)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        outcome = results.get(timeout=120)
    finally:
        done.set()
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
    assert len(outcome) == QUEUED + 1
    assert all(text.startswith("raised:") and "Connection closed" in text for text in outcome), outcome
