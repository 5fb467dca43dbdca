"""What a rank is asked to train: the job's rank-side view, its batch split and checkpoint target.

Plain values (no torch): built once on the driver (``orchestrator/driver/train_spec.py``) and
sent to every rank actor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.spec.model import ModelSpec

# The per-step commit vote's outcomes (see workers/rendezvous.py).
COMMIT = "commit"
COMMIT_AND_PAUSE = "commit_pause"
COMMIT_PAUSE_CHECKPOINT = "commit_pause_checkpoint"
ABORT = "abort"


@dataclass(frozen=True)
class CheckpointTarget:
    """Where and how a rank writes checkpoints (credentials come from the AWS chain, never here)."""

    uri: str
    endpoint_url: str | None = None
    region: str | None = None
    interval_steps: int = 10
    async_save: bool = True
    part_size_bytes: int = 8 << 20
    upload_concurrency: int = 4
    max_in_flight: int = 1


@dataclass(frozen=True)
class TrainSpec:
    """Everything a rank needs to train, except the mesh, which changes with the cluster.

    Built by the driver from the job config; sent to every rank actor once.
    """

    model: ModelSpec
    steps: int
    global_batch: int
    seq_len: int
    # Samples per forward pass; fixed from the first mesh so a smaller mesh accumulates more.
    microbatch_size: int
    microbatches: int = 1
    pp_schedule: str = "1f1b"
    stages_per_rank: int = 1
    activation_checkpointing: bool = False
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    dtype: str = "float32"  # float32, or bfloat16 parameters with float32 gradient reduction
    data_source: str = "synthetic"
    backend: str = "gloo"
    collective_timeout_s: float = 120.0
    checkpoint: CheckpointTarget | None = None
    # Polled by every rank for a spot / maintenance notice of its own instance; "{node_id}"
    # is replaced by the rank's Ray node id (lets a test serve notices per node on loopback).
    instance_action_url: str | None = None
    instance_action_poll_s: float = 2.0

    def accumulation(self, dp: int) -> int:
        """Forward/backward rounds per step so that dp * microbatches * size * rounds = global_batch."""
        per_round = dp * self.microbatches * self.microbatch_size
        rounds, remainder = divmod(self.global_batch, per_round)
        if remainder or rounds < 1:
            raise ValueError(
                f"global_batch={self.global_batch} is not a multiple of dp={dp} x microbatches="
                f"{self.microbatches} x microbatch_size={self.microbatch_size}"
            )
        return rounds

    def lr_at(self, step: int) -> float:
        """Learning rate of (1-based) step: linear warmup, then cosine down to lr * min_lr_ratio."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        decay_steps = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))
