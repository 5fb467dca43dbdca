"""A rank's trainer across a generation change, single process, world size 1, real gloo.

What a surviving rank does between generations (workers/actor.py: keep its slices, close the
trainer, destroy the world, join the next generation, build a new trainer), watched from the
threads that run the trainer: on CUDA, backward runs on autograd's long-lived device thread,
which none of our code starts; here a long-lived second thread runs the backward instead.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

from elastic.spec import MeshSpec
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

SPEC = TrainSpec(model=PRESETS["debug"], steps=2, global_batch=2, seq_len=8, microbatch_size=1, microbatches=2)


@pytest.fixture
def store():
    yield dist.HashStore()
    if dist.is_initialized():
        dist.destroy_process_group()


def join(store, generation: int) -> Trainer:
    """What configure() does on a rank: the generation's groups, fresh caches, a new trainer."""
    if dist.is_initialized():
        dist.destroy_process_group()
    init_generation(store=store, generation=generation, rank=0, world_size=1, backend="gloo", timeout_s=30)
    par.forget_old_meshes()
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = Trainer(SPEC, MeshSpec(), 0, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    return trainer


def forward_loss(trainer: Trainer) -> torch.Tensor:
    tokens = torch.randint(0, SPEC.model.vocab_size, (1, SPEC.seq_len + 1), generator=torch.Generator().manual_seed(0))
    logits = trainer.modules[0](tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def backward_then_reduce(loss: torch.Tensor, dp_mesh) -> torch.Tensor:
    """On the backward thread: the backward, then a DTensor op and a reduction over its mesh."""
    loss.backward()
    gradient = cast(DTensor, DTensor.from_local(torch.full((4,), 2.0), dp_mesh, [Partial()]) * 3)
    reduced = gradient.to_local().clone()
    dist.all_reduce(reduced, group=gradient.device_mesh.get_group())
    return reduced


def test_backward_thread_runs_dtensor_ops_on_the_new_generations_mesh(store):
    with ThreadPoolExecutor(max_workers=1) as backward_thread:  # one long-lived thread
        old = join(store, 0)
        old_dp = par.data_parallel_mesh(old.world_mesh, MeshSpec())
        backward_thread.submit(backward_then_reduce, forward_loss(old), old_dp).result()
        old.close()
        new = join(store, 1)  # back to the same layout: the meshes compare equal
        new_dp = par.data_parallel_mesh(new.world_mesh, MeshSpec())
        assert new_dp == old_dp
        reduced = backward_thread.submit(backward_then_reduce, forward_loss(new), new_dp).result()
    assert torch.equal(reduced, torch.full((4,), 6.0))


def storage_pointers(trainer: Trainer) -> set[int]:
    return {par.local_slice(value).untyped_storage().data_ptr() for value in trainer.named_state().values()}


def test_kept_shards_are_host_copies_that_outlive_the_closed_trainer(store):
    old = join(store, 0)
    old.train_step(1)
    kept = old.local_shards()
    live, digest = storage_pointers(old), old.state_digest()
    old.close()
    assert {value.device.type for value in kept.values()} == {"cpu"}
    assert not {value.untyped_storage().data_ptr() for value in kept.values()} & live
    new = join(store, 1)
    new.load_local_shards(kept)
    assert new.state_digest() == digest


def test_kept_shards_of_a_large_state_on_a_gpu_are_page_locked_in_chunks(store, monkeypatch):
    """A GPU rank's kept state above the one-call limit: one buffer, registered in chunks on page
    boundaries (the limit lowered to this small state; a fake registration: no CUDA here)."""
    from checkpointing import staging

    trainer = join(store, 0)
    trainer.train_step(1)
    state_bytes = sum(par.local_slice(v).nbytes for v in trainer.checkpoint_state(with_base=True).values())
    monkeypatch.setattr(staging, "PIN_IN_ONE_CALL_MAX_BYTES", state_bytes // 2)
    monkeypatch.setattr(staging, "PIN_CHUNK_BYTES", state_bytes // 5)
    registrations: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(
        staging, "register_pinned", lambda storage, offsets: registrations.append((storage.data_ptr(), offsets)) or []
    )
    monkeypatch.setattr(trainer, "device", torch.device("cuda"))  # only whether to page-lock is read
    kept = trainer.local_shards()
    [(base, offsets)] = registrations
    assert len(offsets) >= 5 and all((base + offset) % staging.PAGE_BYTES == 0 for offset in offsets[1:])
    for name, value in trainer.named_state(with_base=True).items():
        assert torch.equal(kept[name], par.local_slice(value)), name
