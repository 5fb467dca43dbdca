"""A surviving rank's trainer across a generation change on a GPU: one process, NCCL, world size 1.

    make test-gpu        # or: python -m pytest tests/gpu/test_generations.py

What a rank that survives a failure does between generations (workers/actor.py: keep its
slices, close the trainer, destroy the world, join the next generation on the same layout,
build a new trainer), with the real CUDA threads: backward runs on autograd's long-lived device
thread, which none of our code starts, so its per-thread DTensor caches outlive the generation
unless the trainer's hooks clear them (tests/unit/test_trainer_generations.py plays that thread
with a Python thread on the CPU). Runs on any machine with one CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic.spec import MeshSpec
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.runtime import init_generation, pick_device
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

SPEC = TrainSpec(
    model=PRESETS["debug"], steps=4, global_batch=2, seq_len=32, microbatch_size=1, microbatches=2, backend="nccl"
)


@pytest.fixture
def store():
    yield dist.HashStore()
    if dist.is_initialized():
        dist.destroy_process_group()


def join(store: dist.Store, generation: int) -> Trainer:
    """What configure() does on a rank: the generation's NCCL group, fresh caches, a new trainer."""
    if dist.is_initialized():
        dist.destroy_process_group()
    device = pick_device("nccl")
    init_generation(
        store=store, generation=generation, rank=0, world_size=1, backend="nccl", timeout_s=60, device=device
    )
    par.forget_old_meshes()
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = Trainer(SPEC, MeshSpec(), 0, device=device, source=source)
    trainer.init_weights()
    return trainer


def test_a_step_after_a_generation_change_back_to_the_same_layout_matches_an_unbroken_run(store):
    unbroken = join(store, 0)
    expected = [unbroken.train_step(step).loss for step in (1, 2, 3)]
    unbroken.close()

    old = join(store, 1)
    first = old.train_step(1).loss
    kept = old.local_shards()
    digest = old.state_digest()
    old.close()
    # Kept shards are host copies: the next generation's trainer allocates its own device memory.
    assert {value.device.type for value in kept.values()} == {"cpu"}

    new = join(store, 2)  # the same layout: the meshes compare equal to generation 1's
    new.load_local_shards(kept)
    assert new.state_digest() == digest
    # The backward of these steps runs DTensor ops on autograd's CUDA device thread, which ran
    # generation 1's backward: a stale cache there fails with "Could not resolve the process group".
    resumed = [new.train_step(step).loss for step in (2, 3)]
    new.close()
    assert [first, *resumed] == pytest.approx(expected, rel=1e-5)
