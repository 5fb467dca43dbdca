"""The ``moe`` family's tensor-parallel plan: llama's attention plan, and the MoE block whole.

Applied on every rank by ``workers.parallelize.apply_tensor_parallel`` when tp > 1. The block
takes its sequence-parallel tokens as they are (a plain tensor of 1/tp of each sequence) and
returns them so; its weights stay whole on every tp rank (FSDP shards them over data x tensor
ranks: ``workers.parallelize.apply_whole_weight_fsdp``).
"""

from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from workers.models.llama.tensor_parallel import ATTENTION_PLAN, TOP_PLAN

LAYER_PLAN: dict[str, ParallelStyle] = {
    **ATTENTION_PLAN,
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True),
}

__all__ = ["LAYER_PLAN", "TOP_PLAN"]
