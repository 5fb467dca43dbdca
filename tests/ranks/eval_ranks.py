"""Ranks (spawned processes, real gloo, no Ray) that evaluate the same weights on their mesh.

For tests/ranks/test_evaluation_on_meshes.py: each rank builds the Trainer for its mesh from the seeded
initialisation, evaluates it (``workers/evaluation.py``), then checks that evaluating changed
nothing of the training: the state before and after, and two steps with an evaluation between
them against two steps of a second trainer without one.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo
from workers import parallelize as par
from workers.data import SyntheticSource
from workers.evaluation import Evaluator
from workers.spec import PRESETS, TrainSpec
from workers.spec.train import BatchPlan
from workers.trainer import Trainer

MODEL = PRESETS["debug"]
GLOBAL_BATCH, SEQ_LEN, MICROBATCHES, EVAL_BATCHES = 8, 32, 2, 2


def eval_source() -> SyntheticSource:
    return SyntheticSource(vocab_size=MODEL.vocab_size, seq_len=SEQ_LEN, seed=0)


def train_spec(mesh: MeshSpec) -> TrainSpec:
    batch = BatchPlan.for_mesh(GLOBAL_BATCH, dp=mesh.dp, microbatches=MICROBATCHES)
    return TrainSpec(
        model=MODEL,
        steps=2,
        global_batch=GLOBAL_BATCH,
        seq_len=SEQ_LEN,
        microbatch_size=batch.microbatch_size,
        microbatches=MICROBATCHES,
    )


def fresh_trainer(mesh: MeshSpec, rank: int) -> Trainer:
    par.forget_old_meshes()
    trainer = Trainer(train_spec(mesh), mesh, rank, device=torch.device("cpu"), source=eval_source())
    trainer.init_weights()
    return trainer


def run_rank(rank: int, store_path: str, results, *, mesh: MeshSpec) -> None:
    join_gloo(rank, store_path, mesh)
    evaluated = fresh_trainer(mesh, rank)
    before = evaluated.state_digest()
    first = Evaluator(evaluated, batches=EVAL_BATCHES).evaluate()
    unchanged = evaluated.state_digest() == before
    evaluated.train_step(1)
    Evaluator(evaluated, batches=EVAL_BATCHES).evaluate()
    with_eval = (evaluated.train_step(2).loss, evaluated.state_digest())
    evaluated.close()
    plain = fresh_trainer(mesh, rank)
    plain.train_step(1)
    without_eval = (plain.train_step(2).loss, plain.state_digest())
    results.put((rank, first.loss, first.tokens, unchanged, with_eval, without_eval))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
