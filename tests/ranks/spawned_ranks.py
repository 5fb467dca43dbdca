"""Run a rank function in spawned processes and collect what each one reports (no Ray).

    outcomes = spawn_ranks(run_rank, world_size=2, store_path=str(tmp / "store"))

``run_rank(rank, store_path, results)`` puts one tuple ``(rank, *values)`` on ``results``;
the answer maps each rank to its values. Inside a rank, ``join_gloo(rank, store_path, mesh)``
opens its generation-0 gloo process group.
"""

from __future__ import annotations

from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from elastic.spec import MeshSpec

# What every rank imports before its function runs: loaded once in the fork server, so a rank
# starts in milliseconds instead of importing torch anew (~2-3 s of a core each).
PRELOADED = ("torch", "torch.distributed", "torch.distributed.tensor", "workers.trainer")


def rank_context() -> ForkServerContext:
    """The multiprocessing context every test's rank processes start from.

    A fork server, not fork: the server is a fresh single-threaded process (the test process may
    hold Ray's and torch's threads), and each rank is forked from it with the imports done.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def spawn_ranks(
    run_rank: Callable[[int, str, Any], None], *, world_size: int, store_path: str, timeout_s: float = 180.0
) -> dict[int, tuple[Any, ...]]:
    context = rank_context()
    results = context.Queue()
    processes = [
        context.Process(target=run_rank, args=(rank, store_path, results), daemon=True) for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=timeout_s) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    return {outcome[0]: outcome[1:] for outcome in outcomes}


def join_gloo(rank: int, store_path: str, mesh: MeshSpec) -> None:
    """In a spawned rank: join generation 0 of a gloo job of ``mesh`` through a file store."""
    from workers.runtime import init_generation

    init_generation(
        store=dist.FileStore(store_path, mesh.world_size),
        generation=0,
        rank=rank,
        world_size=mesh.world_size,
        backend="gloo",
        timeout_s=120,
    )
