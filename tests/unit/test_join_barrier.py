"""The join barrier before torch's rendezvous: it ends on the driver's abort, not the collective timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from workers.rendezvous import JoinAborted, JoinTimeout, join_barrier


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_rank_waiting_for_one_that_died_leaves_as_soon_as_the_generation_is_aborted(store):
    aborted = threading.Event()
    threading.Timer(0.3, aborted.set).start()
    started = time.monotonic()
    with pytest.raises(JoinAborted, match="generation 4 was aborted while rank 0 waited"):
        join_barrier(store, generation=4, rank=0, world_size=2, timeout_s=60, aborted=aborted.is_set)
    assert time.monotonic() - started < 5  # not the 60 s timeout


def test_every_rank_arrived_passes_and_a_missing_one_times_out_naming_it(store):
    other = threading.Thread(
        target=join_barrier,
        kwargs={"store": store, "generation": 1, "rank": 1, "world_size": 2, "timeout_s": 10, "aborted": lambda: False},
    )
    other.start()
    join_barrier(store, generation=1, rank=0, world_size=2, timeout_s=10, aborted=lambda: False)
    other.join(timeout=10)
    with pytest.raises(JoinTimeout, match=r"ranks \[1, 2\] did not join generation 2 within 0.2 s"):
        join_barrier(store, generation=2, rank=0, world_size=3, timeout_s=0.2, aborted=lambda: False)
