"""The ``moe`` family as meshpilot resolves it: ``MoeArgs`` -> ``MoeTransformer``, its
tensor-parallel plan, initialisation rules and Hugging Face names (Qwen2-MoE's).

Runs on every rank (building its stage) and on the driver (names and config.json for
``meshpilot ckpt import``/``export``, a meta-device build to check released weights).
Parameter names are Hugging Face's without ``model.``, except the routed experts: a layer's
experts are three stacked parameters (``mlp.experts.gate_proj`` [n_experts, hidden, dim], ...,
see ``GroupedExperts``). Each maps to ``n_experts`` Hugging Face tensors
(``model.layers.<l>.mlp.experts.<e>.gate_proj.weight``, the stacked parameter's slice ``[e]``),
so import and export stack and unstack them.
"""

from __future__ import annotations

from typing import Any

from checkpointing.hf_format import HfName
from workers.models.family import InitRule, ModelFamily, TensorParallelPlan, register_family
from workers.models.llama.family import LlamaFamily
from workers.models.moe.grouped_experts import EXPERT_WEIGHTS
from workers.models.moe.model import MoeTransformer
from workers.models.moe.tensor_parallel import LAYER_PLAN, TOP_PLAN
from workers.spec.families import MoeArgs
from workers.spec.families.moe_hf import MOE_ARCHITECTURE, moe_hf_config, moe_spec_from_hf

# Initialisation and Hugging Face names are the llama family's.
_LLAMA = LlamaFamily()


def _stacked_expert(fqn: str) -> bool:
    """Whether ``fqn`` is one of a layer's stacked expert parameters (``layers.<l>.mlp.experts.gate_proj``)."""
    parts = fqn.split(".")
    return len(parts) >= 3 and parts[-2] == "experts" and parts[-1] in EXPERT_WEIGHTS


class MoeFamily(ModelFamily[MoeArgs]):
    """Qwen2-MoE-style decoders: llama attention, a mixture-of-experts MLP (see ``workers.models.moe.model``).

    Initialisation, Hugging Face names and tied embeddings are ``llama``'s: each expert's
    ``down_proj`` is a residual branch's output projection (scaled down by sqrt(2 * n_layers)),
    the router and the shared expert's gate draw N(0, 0.02).
    """

    name = "moe"
    args_class = MoeArgs
    hf_architectures = (MOE_ARCHITECTURE,)

    def build(self, spec: MoeArgs) -> MoeTransformer:
        return MoeTransformer(spec)

    def tensor_parallel_plan(self, spec: MoeArgs) -> TensorParallelPlan:
        return TensorParallelPlan(top=TOP_PLAN, layer=LAYER_PLAN)

    def init_rule(self, fqn: str, spec: MoeArgs) -> InitRule:
        if fqn.endswith("mlp.expert_bias"):
            return InitRule.fill(0.0)  # balancing starts from the router's own choice
        # The stacked experts' down_proj is every expert's output projection (llama's rule by name).
        return _LLAMA.init_rule(fqn + ".weight" if _stacked_expert(fqn) else fqn, spec)

    def hf_name(self, fqn: str) -> str:
        return _LLAMA.hf_name(fqn)

    def hf_names(self, spec: MoeArgs, fqn: str) -> HfName:
        """A stacked expert parameter is ``n_experts`` Hugging Face tensors, expert ``e``'s slice ``[e]``."""
        if not _stacked_expert(fqn):
            return self.hf_name(fqn)
        experts, weight = fqn.rsplit(".", 1)
        return tuple(f"model.{experts}.{expert}.{weight}.weight" for expert in range(spec.n_experts))

    def hf_source_names(self, spec: MoeArgs, fqns: list[str], available: set[str]) -> dict[str, HfName]:
        names = _LLAMA.hf_source_names(spec, fqns, available)  # a tied embedding's source
        return {fqn: self.hf_names(spec, fqn) if _stacked_expert(fqn) else name for fqn, name in names.items()}

    def spec_from_hf_config(self, config: dict[str, Any], source: str) -> MoeArgs:
        return moe_spec_from_hf(config, source, family=self.name)

    def hf_config(self, spec: MoeArgs, *, dtype: str) -> dict[str, Any]:
        return moe_hf_config(spec, dtype=dtype)


register_family(MoeFamily)
