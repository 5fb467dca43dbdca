"""The ``llama`` family as meshpilot resolves it: ``LlamaArgs`` -> ``Transformer``, its
tensor-parallel plan, initialisation rules and Hugging Face names.

Runs on every rank (building its stage) and on the driver (names and config.json for
``meshpilot ckpt import``/``export``, a meta-device build to check released weights).
Parameter names are those of Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix,
and rotary embeddings use the same rotate-half convention, so import and export are a rename
and nothing else.
"""

from __future__ import annotations

from typing import Any

from checkpointing.hf_format import HfName
from workers.models.family import InitRule, ModelFamily, TensorParallelPlan, register_family
from workers.models.llama.model import Transformer
from workers.models.llama.tensor_parallel import LAYER_PLAN, TOP_PLAN
from workers.spec.families import LlamaArgs
from workers.spec.families.llama_hf import LLAMA_COMPATIBLE, llama_hf_config, llama_spec_from_hf


class LlamaFamily(ModelFamily[LlamaArgs]):
    """Llama 2/3.x, Mistral, Qwen2/2.5 and SmolLM-class decoders (see the module docstring)."""

    name = "llama"
    args_class = LlamaArgs
    hf_architectures = tuple(LLAMA_COMPATIBLE)

    def build(self, spec: LlamaArgs) -> Transformer:
        return Transformer(spec)

    def tensor_parallel_plan(self, spec: LlamaArgs) -> TensorParallelPlan:
        return TensorParallelPlan(top=TOP_PLAN, layer=LAYER_PLAN)

    def init_rule(self, fqn: str, spec: LlamaArgs) -> InitRule:
        """Norm weights start at one and biases at zero. Output projections of each residual
        branch are scaled down by sqrt(2 * n_layers), as in GPT-2 and Llama's reference
        training code, so the residual stream does not grow with depth."""
        if fqn.endswith("layernorm.weight") or fqn == "norm.weight":
            return InitRule.fill(1.0)
        if fqn.endswith(".bias"):
            return InitRule.fill(0.0)
        if fqn.endswith(("o_proj.weight", "down_proj.weight")):
            return InitRule.normal(0.02 / (2 * spec.n_layers) ** 0.5)
        return InitRule.normal(0.02)

    def spec_from_hf_config(self, config: dict[str, Any], source: str) -> LlamaArgs:
        return llama_spec_from_hf(config, source, family=self.name)

    def hf_config(self, spec: LlamaArgs, *, dtype: str) -> dict[str, Any]:
        return llama_hf_config(spec, dtype=dtype)

    def hf_name(self, fqn: str) -> str:
        return fqn if fqn == "lm_head.weight" else f"model.{fqn}"

    def hf_source_names(self, spec: LlamaArgs, fqns: list[str], available: set[str]) -> dict[str, HfName]:
        """A checkpoint with tied embeddings stores the embedding once: the output projection
        (trained untied here) starts from it."""
        names: dict[str, HfName] = {fqn: self.hf_name(fqn) for fqn in fqns}
        if "lm_head.weight" in names and "lm_head.weight" not in available and spec.tie_embeddings:
            names["lm_head.weight"] = self.hf_name("embed_tokens.weight")
        return names


register_family(LlamaFamily)
