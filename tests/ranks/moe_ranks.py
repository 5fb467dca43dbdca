"""Ranks (spawned processes, real gloo, no Ray) that train the ``debug-moe`` preset for a few steps.

For tests/ranks/test_moe_training.py: each rank builds the Trainer for its mesh, initialises the
model from the seed, trains on synthetic tokens and reports its per-step losses (None where
the rank does not report the loss), the expert load of its last step (``StepResult.expert_load``),
how many experts of a layer it computes, its per-step gradient norms (before clipping) and the
digest of its final state.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from elastic.spec import MeshSpec
from tests.ranks.spawned_ranks import join_gloo
from workers.data import SyntheticSource
from workers.models.moe.grouped_experts import GroupedExperts
from workers.spec import PRESETS, TrainSpec
from workers.trainer import Trainer

STEPS = 10


def moe_train_spec(
    *, activation_checkpointing: bool = False, ep: int = 1, global_batch: int = 8, balancing: dict | None = None
) -> TrainSpec:
    """A global batch of 8 in microbatches of 2 sequences of 32 tokens, so accumulation, pipelining and
    data parallelism all split it differently. ``balancing``: model fields that change how the
    experts are balanced (``router_aux_loss_coef``, ``router_bias_update_rate``)."""
    model = dataclasses.replace(PRESETS["debug-moe"], **(balancing or {}))
    return TrainSpec(
        model=model,
        steps=STEPS,
        global_batch=global_batch,
        seq_len=32,
        microbatch_size=2,
        microbatches=2,
        lr=3e-3,
        activation_checkpointing=activation_checkpointing,
        ep=ep,
    )


def experts_computed(trainer: Trainer) -> int:
    """Collective (FSDP all-gathers): how many experts of a layer this rank holds once gathered for
    its forward, i.e. computes tokens for (n_experts / ep)."""
    block = trainer.modules[0].layers[str(trainer.plans[0].layer_ids[0])]
    experts = block.get_submodule("mlp.experts")
    assert isinstance(experts, GroupedExperts)
    for module in (block, block.get_submodule("mlp"), experts):
        if isinstance(module, FSDPModule):
            module.unshard()
    held = experts.gate_proj.to_local() if isinstance(experts.gate_proj, DTensor) else experts.gate_proj
    trainer.reshard()
    return int(held.shape[0])


def routing_biases(trainer: Trainer) -> dict[str, list[float]]:
    """Collective (FSDP's gathers): every routing bias of this rank's stages, whole, by name."""
    biases = {}
    for module in trainer.modules:
        for name, param in module.named_parameters():
            if name.endswith("expert_bias"):
                whole = param.full_tensor() if isinstance(param, DTensor) else param
                biases[name] = whole.tolist()
    return biases


def run_rank(
    rank: int,
    store_path: str,
    results,
    *,
    mesh: MeshSpec,
    activation_checkpointing: bool = False,
    ep: int = 1,
    global_batch: int = 8,
    balancing: dict | None = None,
) -> None:
    torch.set_num_threads(1)
    join_gloo(rank, store_path, mesh)
    spec = moe_train_spec(
        activation_checkpointing=activation_checkpointing, ep=ep, global_batch=global_batch, balancing=balancing
    )
    source = SyntheticSource(vocab_size=spec.model.vocab_size, seq_len=spec.seq_len, seed=0)
    trainer = Trainer(spec, mesh, rank, device=torch.device("cpu"), source=source)
    trainer.init_weights()
    results_by_step = [trainer.train_step(step) for step in range(1, STEPS + 1)]
    losses = [result.loss for result in results_by_step]
    grad_norms = [result.grad_norm for result in results_by_step]
    held = experts_computed(trainer)
    biases = routing_biases(trainer)
    results.put((rank, losses, results_by_step[-1].expert_load, held, grad_norms, biases, trainer.state_digest()))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
