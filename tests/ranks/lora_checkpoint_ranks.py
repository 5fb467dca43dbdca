"""Ranks (spawned processes, real gloo, no Ray) that save a LoRA run under one mesh and resume it
under another, for tests/ranks/test_lora_training.py.

``save_rank`` LoRA-trains ``SAVED_AT`` steps, writes its shard of the step with the extra a rank's
checkpoints add (``lora_extra``: the settings and the base), gathers the adapters and their optimizer
state whole, and trains on to ``STEPS``. ``restore_rank`` builds a trainer for its own mesh, draws
the base from the seed (``fill_from_source``, as a rank's configure does) and restores the
committed step through ``RankCheckpoints.restore``, then reports the same and the losses after it.
"""

from __future__ import annotations

import dataclasses

import torch

from checkpointing.storage import open_storage
from checkpointing.writer import CheckpointWriter
from elastic.spec import MeshSpec
from tests.ranks.lora_ranks import SPEC, STEPS
from tests.ranks.spawned_ranks import join_gloo, send_and_exit, whole_state
from workers.checkpoints import RankCheckpoints, lora_extra, owns_plain_tensors
from workers.data import SyntheticSource
from workers.pretrained import fill_from_source
from workers.reporting import ReportChannel
from workers.spec.lora import LoraBase
from workers.spec.train import CheckpointTarget
from workers.trainer import Trainer

SAVED_AT = 5
BASE = LoraBase(source="random-init:seed=0", sha256="0" * 64)


def _trainer(rank: int, store_path: str, mesh: MeshSpec, ckpt_dir: str, base: LoraBase) -> Trainer:
    torch.set_num_threads(1)
    join_gloo(rank, store_path, mesh)
    spec = dataclasses.replace(
        SPEC,
        microbatch_size=SPEC.global_batch // (mesh.dp * SPEC.microbatches),
        lora_base=base,
        checkpoint=CheckpointTarget(ckpt_dir, async_save=False),
    )
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    return Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)


def save_rank(rank: int, store_path: str, results, *, mesh: MeshSpec, ckpt_dir: str) -> None:
    trainer = _trainer(rank, store_path, mesh, ckpt_dir, BASE)
    trainer.init_weights()
    for step in range(1, SAVED_AT + 1):
        trainer.train_step(step)
    reports: list = []
    writer = CheckpointWriter(open_storage(ckpt_dir), rank=rank, report=reports.append, mesh=trainer.world_mesh)
    extra = {"step": SAVED_AT, **lora_extra(trainer.spec)}
    writer.save_sync(SAVED_AT, trainer.checkpoint_state(), extra=extra, owns_plain_tensors=owns_plain_tensors(trainer))
    writer.close(wait=True)
    state = whole_state(trainer)
    losses = [trainer.train_step(step).loss for step in range(SAVED_AT + 1, STEPS + 1)]
    send_and_exit(results, rank, reports[0], state, losses)


def restore_rank(rank: int, store_path: str, results, *, mesh: MeshSpec, ckpt_dir: str, base: LoraBase = BASE) -> None:
    trainer = _trainer(rank, store_path, mesh, ckpt_dir, base)
    fill_from_source(trainer)
    checkpoints = RankCheckpoints(trainer.spec, trainer, rank=rank, channel=ReportChannel(rank))
    try:
        checkpoints.restore(SAVED_AT)
    except Exception as error:  # noqa: BLE001 - the test reads the refusal's text
        send_and_exit(results, rank, f"{type(error).__name__}: {error}", None)
    state = whole_state(trainer)
    losses = [trainer.train_step(step).loss for step in range(SAVED_AT + 1, STEPS + 1)]
    checkpoints.close(wait=True)
    send_and_exit(results, rank, state, losses)
