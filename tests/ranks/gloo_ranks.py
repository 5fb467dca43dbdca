"""Two-rank gloo worlds that fail on purpose, for tests/ranks/test_collective_failures.py.

Spawned processes import only torch (not the test module), so they start quickly. Rank 0
sends back the exception its collective raised; the test classifies it in its own process.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 1.0


def run_rank(rank: int, scenario: str, store_path: str, results) -> None:
    """``own_timeout``: rank 1 never joins rank 0's collective. ``peer_dies``: rank 1 crashes."""
    store = dist.FileStore(store_path, 2)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    dist.all_reduce(torch.ones(4))  # the connections between the ranks are up
    if rank == 1:
        if scenario == "peer_dies":
            os._exit(1)  # a crash: the process goes, its sockets close
        store.wait(["seen"], timedelta(seconds=60))  # stays alive, never joins the collective
        os._exit(0)
    try:
        if scenario == "peer_dies":
            time.sleep(0.2)
        dist.all_reduce(torch.ones(4))
        results.put((scenario, None))
    except Exception as error:  # noqa: BLE001 - the error is what the test is about
        results.put((scenario, error))
    store.set("seen", "1")
    results.close()
    results.join_thread()
    os._exit(0)
