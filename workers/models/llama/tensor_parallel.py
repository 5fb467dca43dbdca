"""The ``llama`` family's tensor-parallel plan (``parallelize_module`` styles by submodule name).

Applied on every rank by ``workers.parallelize.apply_tensor_parallel`` when tp > 1: Megatron-style
TP with sequence parallelism, so norms and residuals see 1/tp of the sequence. The last stage's
logits stay sharded over the vocabulary: ``lm_head`` returns a DTensor placed ``Shard(-1)`` (each
rank holds vocab/tp columns), and the trainer computes the loss on the shards under
``loss_parallel``; gathering them would hold the whole (tokens x vocab) logits, and their float32
upcast, on every TP rank.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

TOP_PLAN: dict[str, ParallelStyle] = {
    "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}
# Attention's plan (the ``moe`` family keeps it and plans its own MLP).
ATTENTION_PLAN: dict[str, ParallelStyle] = {
    "input_layernorm": SequenceParallel(),
    "self_attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "post_attention_layernorm": SequenceParallel(),
}
LAYER_PLAN: dict[str, ParallelStyle] = {
    **ATTENTION_PLAN,
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}
