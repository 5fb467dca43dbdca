"""Ranks that train a few steps of the debug model on real gloo, for tests/ranks/test_pipeline_training.py.

Each spawned rank builds a Trainer for the given mesh and TrainSpec fields, runs ``STEPS``
steps on synthetic data, then one forward-only pass on fixed tokens; it sends back its per-step
losses (the ranks that report the loss), its stage indices, and the logits (tp rank 0 of the
ranks holding the last stage).
``run_rank`` is what ``spawn_ranks`` calls (bound with ``functools.partial``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo, spawn_ranks
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


@dataclass
class Run:
    losses: list[float]  # per step, the mean over data-parallel slices
    stages: dict[int, list[int]]  # each rank's stage indices
    logits: list[np.ndarray]  # the trained model's logits, from every rank that returns them


def run_layout(mesh: dict[str, int], spec: dict[str, object], tmp_path) -> Run:
    """Train ``STEPS`` steps of the debug model on ``mesh`` with ``spec``'s TrainSpec fields."""
    world_size = math.prod(mesh.values())
    outcomes = spawn_ranks(
        functools.partial(run_rank, mesh, spec), world_size=world_size, store_path=str(tmp_path / "store")
    )
    reported = [losses for losses, _, _ in outcomes.values() if losses is not None]
    assert len(reported) == mesh.get("dp_shard", 1) * mesh.get("dp_replicate", 1)
    return Run(
        losses=[sum(step) / len(step) for step in zip(*reported)],
        stages={rank: stages for rank, (_, stages, _) in outcomes.items()},
        logits=[logits for _, _, logits in outcomes.values() if logits is not None],
    )


def assert_trains_like(run: Run, single_rank: Run) -> None:
    """Per-step losses within 1e-3 relative of the single rank's, and the trained model's logits."""
    assert run.losses == pytest.approx(single_rank.losses, rel=1e-3)
    assert run.logits  # the ranks holding the last stage returned them
    for logits in run.logits:
        np.testing.assert_allclose(logits, single_rank.logits[0], rtol=1e-3, atol=1e-4)
