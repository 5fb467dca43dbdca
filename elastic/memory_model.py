"""Model-state and working memory per GPU: the ZeRO paper's arithmetic and FSDP2's buffers.

Pure arithmetic (no ray, no torch), used by ``elastic.cost_model`` for every candidate layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.spec import ModelSpec

if TYPE_CHECKING:
    from elastic.cost_model import Layout

# ZeRO paper's mixed-precision Adam: bf16 params + bf16 grads + K=12 optimizer bytes.
PARAM_BYTES = 2
GRAD_BYTES = 2
ADAM_BYTES = 12
# FSDP2 reduces (and, with no-sync, accumulates) gradients in fp32.
REDUCE_BYTES = 4
# A frozen parameter (a LoRA run's base): FSDP2 keeps its fp32 shard (the bf16 copy is only gathered
# for compute) and nothing else: no gradient, no Adam moments.
FROZEN_PARAM_BYTES = 4
ACTIVATION_BYTES = 2  # bf16
# Logits kept for the loss: the bf16 logits and their fp32 upcast.
LOGIT_BYTES = 2 + 4


def zero_memory_per_gpu(
    num_params: float,
    *,
    stage: int,
    dp: int,
    param_bytes: float = PARAM_BYTES,
    grad_bytes: float = GRAD_BYTES,
    optimizer_bytes: float = ADAM_BYTES,
) -> float:
    """Model-state bytes per GPU under ZeRO stage 0 (replicate), 1, 2 or 3 over ``dp`` GPUs.

    The ZeRO paper's arithmetic: (2 + 2 + K)·Ψ unsharded; stage 1 divides the K·Ψ optimizer
    bytes by N_d, stage 2 also the gradients, stage 3 also the parameters.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp!r}")
    params = param_bytes * num_params / (dp if stage >= 3 else 1)
    grads = grad_bytes * num_params / (dp if stage >= 2 else 1)
    optimizer = optimizer_bytes * num_params / (dp if stage >= 1 else 1)
    return params + grads + optimizer


def activation_bytes_per_token(model: ModelSpec) -> float:
    """Bytes one token leaves behind in one layer for the backward pass: the values the family
    counts (``ModelSpec.saved_activations_per_token``, flash attention), 2 bytes each."""
    return ACTIVATION_BYTES * model.saved_activations_per_token()


def fsdp_buffer_bytes(layout: Layout, stage_params: float, layer_params: float, *, reduced_share: float = 1.0) -> float:
    """FSDP2's unsharded working copies on a rank holding ``stage_params`` (0 without sharding).

    Gathered bf16 parameters: the whole stage when they stay gathered (``keeps_gathered``), else
    about two layers (the one running and the one prefetched). fp32 gradients before the
    reduce-scatter: the whole stage with pipelining (the stage skips gradient sync until its last
    microbatch), else two layers; of the ``reduced_share`` of the parameters that trains (LoRA's
    adapters: a frozen base has no gradients).
    """
    if layout.mesh.fsdp_shards == 1:  # FSDP shards over dp_shard x cp
        return 0.0
    pipelined, kept = layout.mesh.pp > 1, layout.keeps_gathered
    gradients = REDUCE_BYTES * reduced_share
    gathered = PARAM_BYTES * stage_params if kept else 2 * PARAM_BYTES * layer_params
    return gathered + (gradients * stage_params if pipelined else 2 * gradients * layer_params)
