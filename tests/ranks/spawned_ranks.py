"""Run a rank function in spawned processes and collect what each one reports (no Ray).

    outcomes = spawn_ranks(run_rank, world_size=2, store_path=str(tmp / "store"))

``run_rank(rank, store_path, results)`` puts one tuple ``(rank, *values)`` on ``results``;
the answer maps each rank to its values. Inside a rank, ``join_gloo(rank, store_path, mesh)``
opens its generation-0 gloo process group, ``whole_state(trainer)`` gathers what its checkpoints
save and ``send_and_exit(results, rank, ...)`` hands the values back. ``commit_step`` writes the
manifest of a step the ranks saved (the driver's part of a checkpoint).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

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


def whole_state(trainer: Any) -> dict[str, np.ndarray]:
    """In a rank, collective over the mesh: every tensor its checkpoints save, whole (same order on
    every rank); as numpy arrays, which pickle by value (a tensor would be passed as a file
    descriptor of this process, gone once it exits)."""
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().numpy().copy()
        for name, value in sorted(trainer.checkpoint_state().items())
    }


def save_shard(trainer: Any, rank: int, ckpt_dir: str, step: int) -> Any:
    """In a rank: write its shard of ``step`` to ``ckpt_dir`` and return its report for the commit."""
    from checkpointing.storage import open_storage
    from checkpointing.writer import CheckpointWriter
    from workers.checkpoints import owns_plain_tensors

    reports: list[Any] = []
    writer = CheckpointWriter(open_storage(ckpt_dir), rank=rank, report=reports.append, mesh=trainer.world_mesh)
    writer.save_sync(step, trainer.checkpoint_state(), owns_plain_tensors=owns_plain_tensors(trainer))
    writer.close(wait=True)
    return reports[0]


def restore_step(trainer: Any, ckpt_dir: str, step: int) -> None:
    """In a rank: load its part of the committed ``step`` in ``ckpt_dir`` into the trainer's state."""
    from checkpointing.catalog import load_manifest
    from checkpointing.reader import restore
    from checkpointing.storage import open_storage

    trainer.ensure_optimizer_state()
    storage = open_storage(ckpt_dir)
    restore(storage, load_manifest(storage, step), trainer.checkpoint_state())


def send_and_exit(results: Any, *values: Any) -> None:
    """In a rank: hand ``values`` to the test, wait for the other ranks, leave without teardown."""
    results.put(values)
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


def commit_step(ckpt_dir: str, reports: list[Any], *, step: int, mesh: MeshSpec, model: dict[str, Any]) -> Any:
    """The driver's part of a checkpoint the ranks saved: its manifest, put-if-absent; returns it."""
    from checkpointing.manifest import build_manifest
    from checkpointing.spec import manifest_key
    from checkpointing.storage import open_storage

    manifest = build_manifest(
        reports, step=step, world_size=mesh.world_size, mesh=mesh.as_dict(), model=model, config_hash=None
    )
    assert open_storage(ckpt_dir).put_if_absent(manifest_key(step), manifest.to_json()), "step already committed"
    return manifest
