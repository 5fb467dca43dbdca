"""Read a Hugging Face ``config.json`` of a Llama-compatible decoder into ``LlamaArgs``, and write one.

No torch here: the driver reads the config while it validates a job, before any worker starts.
Covers the architectures the ``llama`` family builds (Llama 2/3.x, Mistral, Qwen2/2.5, and the
SmolLM-class models, which are ``LlamaForCausalLM``); both the older layout (``rope_theta`` and
``rope_scaling`` at the top) and the newer ``rope_parameters`` are read.
"""

from __future__ import annotations

from typing import Any

from workers.spec.families.llama import LlamaArgs, RopeScaling

# Hugging Face architecture -> whether its q/k/v projections carry biases.
LLAMA_COMPATIBLE = {"LlamaForCausalLM": False, "MistralForCausalLM": False, "Qwen2ForCausalLM": True}


class HfConfigError(ValueError):
    """A config.json this family cannot build; the message names the key and the fix."""


def architecture_of(config: dict[str, Any], source: str) -> str:
    """The single entry of ``architectures`` (the class that wrote the weights)."""
    names = config.get("architectures") or []
    if not isinstance(names, list) or len(names) != 1:
        raise HfConfigError(
            f"{source}: 'architectures' is {names!r}; it must name the one model class that wrote the "
            'weights (e.g. ["LlamaForCausalLM"]), or set model.family explicitly'
        )
    return str(names[0])


def llama_spec_from_hf(config: dict[str, Any], source: str, *, family: str = "llama") -> LlamaArgs:
    """The shape of a Llama-compatible decoder; refuses what the family does not build."""
    architecture = architecture_of(config, source)
    if architecture not in LLAMA_COMPATIBLE:
        raise HfConfigError(
            f"{source}: architecture {architecture} is not supported; supported: "
            f"{', '.join(sorted(LLAMA_COMPATIBLE))} (or bring your own family: model.family: package.module:Class)"
        )
    _refuse_unbuilt_features(config, source)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    return LlamaArgs(
        **decoder_fields(config, source),
        family=family,
        qkv_bias=LLAMA_COMPATIBLE[architecture],
        sliding_window=int(window) if window else None,
    )


def decoder_fields(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The shape fields every decoder config.json of ours gives alike (Llama, Qwen2, Qwen2-MoE)."""
    heads = _int(config, "num_attention_heads", source)
    dim = _int(config, "hidden_size", source)
    head_dim = config.get("head_dim")
    return {
        "dim": dim,
        "n_layers": _int(config, "num_hidden_layers", source),
        "n_heads": heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or heads),
        "vocab_size": _int(config, "vocab_size", source),
        "ffn_dim": _int(config, "intermediate_size", source),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(config),
        "max_seq_len": int(config.get("max_position_embeddings") or 8192),
        "attention_head_dim": int(head_dim) if head_dim and int(head_dim) != dim // heads else None,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope_scaling": _rope_scaling(config, source),
    }


def _refuse_unbuilt_features(config: dict[str, Any], source: str) -> None:
    activation = config.get("hidden_act", "silu")
    if activation != "silu":
        raise HfConfigError(f"{source}: hidden_act={activation!r}; the llama family builds SwiGLU (silu) only")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise HfConfigError(
                f"{source}: {key}=true is not built by the llama family (only Qwen2's q/k/v biases are); "
                "bring your own family for this model"
            )


def _int(config: dict[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HfConfigError(f"{source}: {key} must be a positive integer, found {value!r}")
    return value


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def _rope_theta(config: dict[str, Any]) -> float:
    return float(_rope_parameters(config).get("rope_theta") or config.get("rope_theta") or 10000.0)


def _rope_scaling(config: dict[str, Any], source: str) -> RopeScaling | None:
    params = _rope_parameters(config)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise HfConfigError(f"{source}: rope scaling of type {kind!r} is not supported; supported: llama3 (or none)")
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def llama_hf_config(spec: LlamaArgs, *, dtype: str) -> dict[str, Any]:
    """``config.json`` of the matching Hugging Face model (the inverse of ``llama_spec_from_hf``).

    Written as ``Qwen2ForCausalLM`` when the q/k/v projections have biases, else as
    ``LlamaForCausalLM`` (a Mistral shape within its sliding window is a Llama shape). The
    output projection is exported as its own tensor: ``tie_word_embeddings`` is false.
    """
    architecture = "Qwen2ForCausalLM" if spec.qkv_bias else "LlamaForCausalLM"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": spec.rope_theta, **_scaling_dict(spec.rope_scaling)}
    return {
        "architectures": [architecture],
        "model_type": "qwen2" if spec.qkv_bias else "llama",
        **decoder_config(spec),
        "rope_scaling": None if spec.rope_scaling is None else rope,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def _scaling_dict(scaling: RopeScaling) -> dict[str, Any]:
    return {
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def decoder_config(spec: LlamaArgs) -> dict[str, Any]:
    """The config.json keys every decoder of ours writes alike (the inverse of ``decoder_fields``)."""
    return {
        "hidden_size": spec.dim,
        "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.n_layers,
        "num_attention_heads": spec.n_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_seq_len,
    }
