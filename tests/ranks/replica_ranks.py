"""Two replica groups of one rank each (HSDP, dp_replicate=2) on real gloo, for
tests/ranks/test_replica_agreement.py. Each spawned rank builds a Trainer, lets replica group 1
drift, refills it from replica group 0 with a small broadcast cap, then runs one step with
replica group 1's own gradient norm perturbed; it sends back what the test compares.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from workers import parallelize as par
from workers import trainer as trainer_module
from workers import trainer_state
from workers.data import SyntheticSource
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec

SYNC_CAP_BYTES = 4096
# Clips every step of the debug model, so the clip factor decides the update.
SPEC = TrainSpec(
    model=PRESETS["debug"], steps=1, global_batch=4, seq_len=8, microbatch_size=1, microbatches=2, grad_clip=0.01
)


def host_state(trainer: trainer_module.Trainer) -> dict[str, Any]:
    """This rank's slices as numpy arrays (plain pickles: torch's shared-memory tensors would
    not outlive the process that sends them)."""
    return {name: par.local_slice(value).detach().numpy().copy() for name, value in trainer.named_state().items()}


def recording(calls: list[int], collective: Any) -> Any:
    """``collective`` that also records each call's message size in bytes."""

    def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.numel() * tensor.element_size())
        return collective(tensor, *args, **kwargs)

    return call


def run_rank(rank: int, store_path: str, results) -> None:
    init_generation(
        store=dist.FileStore(store_path, 2), generation=0, rank=rank, world_size=2, backend="gloo", timeout_s=60
    )
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = trainer_module.Trainer(SPEC, MeshSpec(dp_replicate=2), rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    trainer.ensure_optimizer_state()
    before_sync = host_state(trainer)
    if rank == 1:  # replica group 1 has drifted (or was never filled)
        with torch.no_grad():
            for value in trainer.named_state().values():
                par.local_slice(value).add_(1.0)
    trainer_state.SYNC_CHUNK_BYTES = SYNC_CAP_BYTES
    broadcasts: list[int] = []
    dist.broadcast = recording(broadcasts, dist.broadcast)
    trainer.sync_from_first_replica()
    after_sync = host_state(trainer)
    if rank == 1:  # replica group 1 reduces its norm in another order: a slightly different value
        own_norm = torch.nn.utils.get_total_norm
        torch.nn.utils.get_total_norm = lambda *args, **kwargs: own_norm(*args, **kwargs) * 1.001
    all_reduces: list[int] = []
    dist.all_reduce = recording(all_reduces, dist.all_reduce)
    step = trainer.train_step(1)
    results.put((rank, before_sync, after_sync, broadcasts, step.grad_norm, host_state(trainer), len(all_reduces)))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
