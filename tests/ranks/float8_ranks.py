"""Four spawned gloo ranks for tests/ranks/test_float8_training.py: the same steps on a pp=2 x
dp_shard=2 mesh with ``training.float8`` on and off.

With float8 on, FSDP2 gathers each weight in float8 across the two data-parallel ranks of a stage,
and every stage's scales are computed after each optimizer step. The CPU has no float8 matmul: the
device check is passed over and torchao emulates the casts (float8 values, float32 matmuls).
"""

from __future__ import annotations

from typing import Any

import torch

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo, send_and_exit, whole_state

MESH = MeshSpec(dp_shard=2, pp=2)
STEPS = 3


def run_rank(rank: int, store_path: str, results: Any) -> None:
    from workers import float8
    from workers.data import SyntheticSource
    from workers.spec import PRESETS, TrainSpec
    from workers.trainer import Trainer

    float8.float8_problem = lambda device: None  # the CPU: emulated casts
    join_gloo(rank, store_path, MESH)
    losses, states = {}, {}
    for float8_on in (True, False):
        spec = TrainSpec(
            model=PRESETS["debug"],
            steps=STEPS,
            global_batch=4,
            seq_len=16,
            microbatch_size=1,
            microbatches=2,
            float8=float8_on,
        )
        source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
        trainer = Trainer(spec, MESH, rank, device=torch.device("cpu"), source=source)
        trainer.init_weights()
        losses[float8_on] = [trainer.train_step(step).loss for step in range(1, STEPS + 1)]
        states[float8_on] = whole_state(trainer)
        trainer.close()
    send_and_exit(results, rank, losses, states)
