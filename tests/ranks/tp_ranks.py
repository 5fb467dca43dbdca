"""Two tensor-parallel ranks (tp=2) on real gloo, for tests/ranks/test_loss_parallel.py.

Each spawned rank builds a Trainer, runs the last stage's forward on fixed tokens and computes
the microbatch loss as the step does; it also computes the replicated reference (the whole
logits gathered, upcast, plain cross entropy) and the gradients of both with respect to the
logits, and sends back what the test compares.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from elastic.spec import MeshSpec
from workers.data import IGNORE_INDEX, SyntheticSource
from workers.runtime import init_generation
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

SPEC = TrainSpec(model=PRESETS["debug"], steps=1, global_batch=2, seq_len=8, microbatch_size=1, microbatches=2)


def run_rank(rank: int, store_path: str, results) -> None:
    init_generation(
        store=dist.FileStore(store_path, 2), generation=0, rank=rank, world_size=2, backend="gloo", timeout_s=60
    )
    source = SyntheticSource(vocab_size=SPEC.model.vocab_size, seq_len=SPEC.seq_len, seed=0)
    trainer = Trainer(SPEC, MeshSpec(tp=2), rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    tokens = torch.randint(0, SPEC.model.vocab_size, (2, SPEC.seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :3] = IGNORE_INDEX  # masked labels: the vocabulary-parallel loss skips them too
    trainer.loss_scale = 0.25  # as a step sets it: dp x cp / trained labels of the global batch
    with trainer.vocab_parallel_loss():
        logits = trainer.modules[0](inputs)
        loss = trainer.microbatch_loss(logits, labels)
        (logits_grad,) = torch.autograd.grad(loss, logits)
    held = logits.to_local() if isinstance(logits, DTensor) else logits
    placements = [str(p) for p in logits.placements] if isinstance(logits, DTensor) else None
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    reference_logits = full.detach().float().requires_grad_()
    reference = F.cross_entropy(reference_logits.flatten(0, 1), labels.flatten(), reduction="sum") * 0.25
    (reference_grad,) = torch.autograd.grad(reference, reference_logits)
    grad_held = logits_grad.to_local() if isinstance(logits_grad, DTensor) else logits_grad
    results.put(
        (
            rank,
            tuple(held.shape),
            placements,
            type(loss).__name__,
            float(loss),
            float(reference),
            grad_held.detach().float().numpy().copy(),
            reference_grad.numpy().copy(),
        )
    )
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
