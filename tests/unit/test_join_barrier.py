"""The join barrier before torch's rendezvous: it ends on the driver's abort, not the collective timeout."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
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


def test_an_abort_that_overtakes_its_configure_call_ends_that_configure_at_once(store, monkeypatch):
    """The driver aborts generation 2 while this rank still leaves generation 1 (dropping its
    groups), so the abort runs before the configure call of generation 2 got to set it. That
    configure must end at once, not wait for the missing rank until the collective timeout."""
    import logging
    import signal

    from elastic.spec import MeshSpec
    from orchestrator.config import load_config
    from orchestrator.driver.train_spec import train_spec
    from tests.jobs import DEMO_CONFIG
    from workers.actor import RankActor
    from workers.reporting import RankLogHandler
    from workers.spec.messages import StartFrom

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the actor's SIGTERM watch is its process's
    config = load_config(DEMO_CONFIG, ["elastic.collective_timeout_s=20"])
    threads = torch.get_num_threads()  # a rank actor takes one; the tests after this one keep theirs
    actor = RankActor(spec=train_spec(config), data=None)
    try:
        actor.abort_collectives(2)
        started = time.monotonic()
        with pytest.raises(Exception, match="generation 2 was aborted while rank 0 waited"):
            actor.configure(
                generation=2,
                rank=0,
                mesh=MeshSpec(dp_shard=2),
                store_address=("127.0.0.1", store.port),
                start=StartFrom(),
            )
        assert time.monotonic() - started < 5  # not the 20 s timeout
    finally:
        torch.set_num_threads(threads)
        logger = logging.getLogger("meshpilot")
        for handler in [h for h in logger.handlers if isinstance(h, RankLogHandler)]:
            logger.removeHandler(handler)
