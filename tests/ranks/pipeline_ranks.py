"""Ranks that train a few steps of the debug model on real gloo, for tests/ranks/test_pipeline_training.py.

Each spawned rank builds a Trainer for the given mesh and TrainSpec fields, runs ``STEPS``
steps on synthetic data, then one forward-only pass on fixed tokens; it sends back its per-step
losses (the ranks that report the loss), its stage indices, and the logits (tp rank 0 of the
ranks holding the last stage).
``run_rank`` is what ``spawn_ranks`` calls (bound with ``functools.partial``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo
from workers.data import SyntheticSource
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

STEPS = 10
SPEC = TrainSpec(
    model=PRESETS["debug"],
    steps=STEPS,
    global_batch=8,
    seq_len=16,
    microbatch_size=1,
    microbatches=8,
    lr=1e-3,
    warmup_steps=2,
)


def run_rank(mesh_fields: dict[str, int], spec_fields: dict[str, Any], rank: int, store_path: str, results) -> None:
    mesh = MeshSpec(**mesh_fields)
    join_gloo(rank, store_path, mesh)
    torch.set_num_threads(1)
    microbatches = spec_fields.get("microbatches", SPEC.microbatches)
    global_batch = spec_fields.get("global_batch", SPEC.global_batch)
    microbatch_size = global_batch // (mesh.dp * microbatches)
    spec = dataclasses.replace(SPEC, microbatch_size=microbatch_size, **spec_fields)
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    losses = [trainer.train_step(step).loss for step in range(1, STEPS + 1)]
    # Forward only after training (the schedule's eval path, as evaluation runs it): the trained
    # model's logits on fixed tokens, the same on every mesh.
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.model.vocab_size, (SPEC.microbatches, spec.seq_len), generator=generator)
    logits = trainer.logits(tokens)
    held_logits = logits.detach().numpy().copy() if logits is not None and trainer.coords.tp == 0 else None
    stages = [plan.stage_index for plan in trainer.plans]
    results.put((rank, losses if trainer.reports_loss else None, stages, held_logits))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
