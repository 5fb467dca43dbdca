"""Ranks (spawned processes, real gloo, no Ray) that train the ``debug`` preset with sequences
split over context-parallel ranks, for tests/ranks/test_context_parallel_training.py.

``run_rank`` builds the Trainer for its mesh, initialises the model from the seed, reads the
logits of fixed tokens (gathered over cp and tp on the last stage), then trains on synthetic
tokens and reports its per-step losses (None where the rank does not report the loss) and
the evaluation loss after training. ``save_rank`` trains ``SAVED_AT`` steps under one mesh and
cp method, writes its shard of the step and trains on to ``STEPS`` (reporting every step's
loss); ``restore_rank`` restores that step under another mesh and method and trains the same
steps after it.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from elastic.spec import CpMethod, MeshSpec
from tests.ranks.spawned_ranks import join_gloo, restore_step, save_shard, send_and_exit, whole_state
from workers.data import SyntheticSource
from workers.evaluation import Evaluator
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

STEPS = 10
SAVED_AT = 5


def cp_train_spec(*, activation_checkpointing: bool = False, cp_method: CpMethod = CpMethod.ALLGATHER) -> TrainSpec:
    """A global batch of 8 in 2 microbatches of sequences of 32 tokens: 4 chunks of 8 per cp=2."""
    return TrainSpec(
        model=PRESETS["debug"],
        steps=STEPS,
        global_batch=8,
        seq_len=32,
        microbatch_size=2,
        microbatches=2,
        lr=3e-3,
        activation_checkpointing=activation_checkpointing,
        cp_method=cp_method,
    )


def fixed_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))


def run_rank(
    rank: int,
    store_path: str,
    results,
    *,
    mesh: MeshSpec,
    activation_checkpointing: bool = False,
    cp_method: CpMethod = CpMethod.ALLGATHER,
) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, store_path, mesh)
    spec = cp_train_spec(activation_checkpointing=activation_checkpointing, cp_method=cp_method)
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    logits = trainer.logits(fixed_tokens(spec.model.vocab_size))
    losses = [trainer.train_step(step).loss for step in range(1, STEPS + 1)]
    evaluation = Evaluator(trainer, batches=1).evaluate()
    results.put((rank, losses, None if logits is None else logits.numpy().copy(), evaluation.loss))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


def _trainer(rank: int, store_path: str, mesh: MeshSpec, cp_method: CpMethod) -> Trainer:
    torch.set_num_threads(1)
    join_gloo(rank, store_path, mesh)
    spec = cp_train_spec(cp_method=cp_method)
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    return Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)


def save_rank(rank: int, store_path: str, results, *, mesh: MeshSpec, cp_method: CpMethod, ckpt_dir: str) -> None:
    trainer = _trainer(rank, store_path, mesh, cp_method)
    trainer.init_weights()
    losses = [trainer.train_step(step).loss for step in range(1, SAVED_AT + 1)]
    report = save_shard(trainer, rank, ckpt_dir, SAVED_AT)
    state = whole_state(trainer)
    losses += [trainer.train_step(step).loss for step in range(SAVED_AT + 1, STEPS + 1)]
    send_and_exit(results, rank, report, state, losses)


def restore_rank(rank: int, store_path: str, results, *, mesh: MeshSpec, cp_method: CpMethod, ckpt_dir: str) -> None:
    trainer = _trainer(rank, store_path, mesh, cp_method)
    restore_step(trainer, ckpt_dir, SAVED_AT)
    state = whole_state(trainer)
    losses = [trainer.train_step(step).loss for step in range(SAVED_AT + 1, STEPS + 1)]
    send_and_exit(results, rank, state, losses)
