"""The ``moe`` family (Qwen2-MoE, ``debug-moe``): its torch half.

    model.py            MixtureOfExperts (router, experts, shared expert, balancing) and MoeTransformer
    grouped_experts.py  a layer's routed experts as stacked parameters, and the ep token exchange
    tensor_parallel.py  the tensor-parallel plan (llama's attention, the MoE block whole)
    family.py           MoeFamily: build, TP plan, init rules, Hugging Face names (registered as ``moe``)

The torch-free half (MoeArgs: fields, counts, validation; the config.json reader and writer)
is ``workers.spec.families.moe`` and ``moe_hf``, which the planner and the driver read.
"""

from workers.models.moe.family import MoeFamily
from workers.models.moe.model import MixtureOfExperts, MoeTransformer

__all__ = ["MixtureOfExperts", "MoeFamily", "MoeTransformer"]
