"""Model families: the code that builds, shards, initialises and names a model architecture.

    family.py  ModelFamily (what a family provides), StageModel (what a built model must be),
               InitRule, TensorParallelPlan, and the registry (resolve_family)
    llama/     the ``llama`` family: Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM
    moe/       the ``moe`` family: a mixture-of-experts MLP on llama's attention (Qwen2-MoE)

Each family folder holds its model, tensor-parallel plan and ``ModelFamily`` (init rules,
Hugging Face names); its torch-free args and config.json reader are ``workers.spec.families``.
Importing this package registers the shipped families.
"""

from workers.models.family import (
    FamilyError,
    InitRule,
    ModelFamily,
    StageModel,
    TensorParallelPlan,
    family_for_architecture,
    register_family,
    registered_families,
    resolve_family,
)
from workers.models.llama import LlamaFamily, Transformer
from workers.models.moe import MoeFamily, MoeTransformer

__all__ = [
    "FamilyError",
    "InitRule",
    "LlamaFamily",
    "ModelFamily",
    "MoeFamily",
    "MoeTransformer",
    "StageModel",
    "TensorParallelPlan",
    "Transformer",
    "family_for_architecture",
    "register_family",
    "registered_families",
    "resolve_family",
]
