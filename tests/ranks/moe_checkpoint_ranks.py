"""Ranks (spawned processes, real gloo, no Ray) that save ``debug-moe`` under one expert-parallel
degree and restore it under another, for tests/ranks/test_moe_training.py.

``save_rank`` trains ``SAVED_AT`` steps, writes its shard of the step (``CheckpointWriter``), gathers
the whole state (every parameter and optimizer tensor, full) for the test to compare with, and
trains on to step ``STEPS``. ``restore_rank`` builds a trainer for its own mesh, restores the
committed step and reports its whole state and the losses of the steps after it.
"""

from __future__ import annotations

import torch

from elastic.spec import MeshSpec
from tests.ranks.moe_ranks import STEPS, moe_train_spec
from tests.ranks.spawned_ranks import join_gloo, restore_step, save_shard, send_and_exit, whole_state
from workers.data import SyntheticSource
from workers.trainer import Trainer

SAVED_AT = 5


def _trainer(rank: int, store_path: str, mesh: MeshSpec, ep: int, balancing: dict | None) -> Trainer:
    torch.set_num_threads(1)
    join_gloo(rank, store_path, mesh)
    spec = moe_train_spec(ep=ep, balancing=balancing)
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    return Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)


def save_rank(
    rank: int, store_path: str, results, *, mesh: MeshSpec, ep: int, ckpt_dir: str, balancing: dict | None = None
) -> None:
    trainer = _trainer(rank, store_path, mesh, ep, balancing)
    trainer.init_weights()
    for step in range(1, SAVED_AT + 1):
        trainer.train_step(step)
    report = save_shard(trainer, rank, ckpt_dir, SAVED_AT)
    state = whole_state(trainer)
    losses = [trainer.train_step(step).loss for step in range(SAVED_AT + 1, STEPS + 1)]
    send_and_exit(results, rank, report, state, losses)


def restore_rank(
    rank: int, store_path: str, results, *, mesh: MeshSpec, ep: int, ckpt_dir: str, balancing: dict | None = None
) -> None:
    trainer = _trainer(rank, store_path, mesh, ep, balancing)
    restore_step(trainer, ckpt_dir, SAVED_AT)
    state = whole_state(trainer)
    losses = [trainer.train_step(step).loss for step in range(SAVED_AT + 1, STEPS + 1)]
    send_and_exit(results, rank, state, losses)
