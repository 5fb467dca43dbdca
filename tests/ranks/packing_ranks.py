"""Ranks (spawned processes, real gloo, no Ray) that train the ``debug`` preset on a masked
corpus, packed by documents or cut in windows, for tests/ranks/test_packed_training.py.

Each rank builds the Trainer for its mesh over the corpus at ``corpus_uri`` (``data.packing``:
``packing``), initialises the model from the seed, trains ``STEPS`` steps and reports its
per-step losses (None where the rank does not report the loss), gradient norms and trained-token
counts, and the evaluation loss after training.
"""

from __future__ import annotations

import torch

from elastic.spec import CpMethod, MeshSpec
from tests.ranks.spawned_ranks import join_gloo, send_and_exit
from workers.evaluation import Evaluator
from workers.spec import PRESETS, TrainSpec
from workers.spec.tokens import Packing
from workers.spec.train import TokenCorpusSource
from workers.token_source import TokenSource
from workers.trainer import Trainer

STEPS = 4


def packing_train_spec(
    corpus_uri: str, packing: Packing = Packing.DOCUMENTS, cp_method: CpMethod = CpMethod.ALLGATHER
) -> TrainSpec:
    """A global batch of 8 in microbatches of 2, 2 per round: one rank accumulates 2 rounds."""
    return TrainSpec(
        model=PRESETS["debug"],
        steps=STEPS,
        global_batch=8,
        seq_len=64,
        microbatch_size=2,
        microbatches=2,
        lr=3e-3,
        data_source="tokens",
        tokens=TokenCorpusSource(corpus_uri, packing=packing),
        cp_method=cp_method,
    )


def run_rank(
    rank: int,
    store_path: str,
    results,
    *,
    mesh: MeshSpec,
    corpus_uri: str,
    packing: Packing = Packing.DOCUMENTS,
    cp_method: CpMethod = CpMethod.ALLGATHER,
) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, store_path, mesh)
    spec = packing_train_spec(corpus_uri, packing, cp_method)
    assert spec.tokens is not None
    source = TokenSource(spec.tokens, seq_len=spec.seq_len, seed=spec.seed)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    steps = [trainer.train_step(step) for step in range(1, STEPS + 1)]
    evaluation = Evaluator(trainer, batches=1).evaluate()
    source.close()
    send_and_exit(
        results,
        rank,
        [step.loss for step in steps],
        [step.grad_norm for step in steps],
        [step.trained_tokens for step in steps],
        evaluation.loss,
        evaluation.tokens,
    )
