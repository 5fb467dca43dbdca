"""Ranks that LoRA-train the debug model on real gloo, for tests/ranks/test_lora_training.py.

Each spawned rank builds a Trainer with adapters on every linear layer of the blocks for the
given mesh, runs ``STEPS`` steps on synthetic data, then one forward-only pass on fixed tokens.
It sends back its per-step losses (the ranks that report the loss), the logits (tp rank 0 of
the ranks holding the last stage), and what it saw of the frozen base: whether its slices of
every base weight are bit-identical to before training, which parameters got gradients, and
which hold optimizer state. ``run_rank`` is what ``spawn_ranks`` calls (bound with ``functools.partial``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo, send_and_exit
from workers.data import SyntheticSource
from workers.parallelize import local_slice
from workers.spec import PRESETS, TrainSpec
from workers.spec.lora import LORA_TARGETS, LoraSpec, is_adapter
from workers.trainer import Trainer

STEPS = 10
SPEC = TrainSpec(
    model=PRESETS["debug"],
    steps=STEPS,
    global_batch=8,
    seq_len=16,
    microbatch_size=1,
    microbatches=4,
    lr=1e-2,
    warmup_steps=2,
    lora=LoraSpec(rank=4, alpha=8.0, target_modules=LORA_TARGETS),
)


def run_rank(mesh_fields: dict[str, int], spec_fields: dict[str, Any], rank: int, store_path: str, results) -> None:
    mesh = MeshSpec(**mesh_fields)
    join_gloo(rank, store_path, mesh)
    torch.set_num_threads(1)
    microbatches = spec_fields.get("microbatches", SPEC.microbatches)
    microbatch_size = SPEC.global_batch // (mesh.dp * microbatches)
    spec = dataclasses.replace(SPEC, microbatch_size=microbatch_size, **spec_fields)
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    parameters = {name: param for module in trainer.modules for name, param in module.named_parameters()}
    base_before = {name: local_slice(p).clone() for name, p in parameters.items() if not is_adapter(name)}
    losses = [trainer.train_step(step).loss for step in range(1, STEPS + 1)]
    base_unchanged = all(torch.equal(local_slice(parameters[name]), before) for name, before in base_before.items())
    with_grad = sorted({name for name, p in parameters.items() if p.grad is not None})
    with_state = sorted({name for name, p in parameters.items() if trainer.optimizer.state.get(p)})
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.model.vocab_size, (spec.microbatches, spec.seq_len), generator=generator)
    logits = trainer.logits(tokens)
    held_logits = logits.detach().numpy().copy() if logits is not None and trainer.coords.tp == 0 else None
    saved = sorted(trainer.named_state())
    send_and_exit(
        results,
        rank,
        losses if trainer.reports_loss else None,
        held_logits,
        base_unchanged,
        with_grad,
        with_state,
        saved,
    )
