"""Read and write the Hugging Face ``config.json`` of a Qwen2-MoE decoder (the ``moe`` family).

No torch here: the driver reads the config while it validates a job, before any worker starts.
Every layer must be a mixture of experts (``decoder_sparse_step=1``, no ``mlp_only_layers``);
the shared expert is gated as Qwen2-MoE gates it.
"""

from __future__ import annotations

from typing import Any

from workers.spec.families.llama_hf import HfConfigError, _int, architecture_of, decoder_config, decoder_fields
from workers.spec.families.moe import MoeArgs

MOE_ARCHITECTURE = "Qwen2MoeForCausalLM"


def moe_spec_from_hf(config: dict[str, Any], source: str, *, family: str = "moe") -> MoeArgs:
    """The shape of a Qwen2-MoE decoder; refuses what the family does not build."""
    architecture = architecture_of(config, source)
    if architecture != MOE_ARCHITECTURE:
        raise HfConfigError(
            f"{source}: architecture {architecture} is not built by the moe family ({MOE_ARCHITECTURE})"
        )
    _refuse_dense_layers(config, source)
    shared_width = int(config.get("shared_expert_intermediate_size") or 0)
    return MoeArgs(
        **decoder_fields(config, source),
        family=family,
        # Configs written before transformers 5 have no such key: Qwen2-MoE always had the biases.
        qkv_bias=bool(config.get("qkv_bias", True)),
        n_experts=_int(config, "num_experts", source),
        top_k_experts=_int(config, "num_experts_per_tok", source),
        moe_ffn_dim=_int(config, "moe_intermediate_size", source),
        n_shared_experts=1 if shared_width else 0,
        shared_expert_ffn_dim=shared_width or None,
        normalize_top_k=bool(config.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)),
    )


def _refuse_dense_layers(config: dict[str, Any], source: str) -> None:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise HfConfigError(f"{source}: hidden_act={activation!r}; the moe family builds SwiGLU (silu) experts only")
    if int(config.get("decoder_sparse_step", 1)) != 1 or config.get("mlp_only_layers"):
        raise HfConfigError(
            f"{source}: decoder_sparse_step={config.get('decoder_sparse_step')} / mlp_only_layers="
            f"{config.get('mlp_only_layers')}: the moe family builds a mixture of experts in every layer; "
            "set decoder_sparse_step=1 and mlp_only_layers=[]"
        )
    if config.get("use_sliding_window"):
        raise HfConfigError(f"{source}: use_sliding_window=true is not built by the moe family; set it to false")


def moe_hf_config(spec: MoeArgs, *, dtype: str) -> dict[str, Any]:
    """``config.json`` of the matching ``Qwen2MoeForCausalLM`` (the inverse of ``moe_spec_from_hf``).

    The shared experts are exported as Qwen2-MoE's one gated shared expert of their joint width.
    """
    if spec.router_score != "softmax" or spec.rope_scaling is not None:
        raise HfConfigError(
            f"{MOE_ARCHITECTURE} routes by softmax scores without rope scaling; this model (router_score="
            f"{spec.router_score}, rope_scaling={spec.rope_scaling}) has no Hugging Face equivalent"
        )
    if spec.router_bias_update_rate > 0:
        raise HfConfigError(
            f"{MOE_ARCHITECTURE} has no routing bias; this model (router_bias_update_rate="
            f"{spec.router_bias_update_rate}) routes by one and has no Hugging Face equivalent"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    return {
        "architectures": [MOE_ARCHITECTURE],
        "model_type": "qwen2_moe",
        **decoder_config(spec),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "qkv_bias": spec.qkv_bias,
        "num_experts": spec.n_experts,
        "num_experts_per_tok": spec.top_k_experts,
        "moe_intermediate_size": spec.expert_ffn_dim,
        "shared_expert_intermediate_size": spec.shared_ffn_dim,
        "norm_topk_prob": spec.normalize_top_k,
        "router_aux_loss_coef": spec.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
    }
