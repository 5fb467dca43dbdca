"""Small random Hugging Face models, built and saved by ``transformers``, one per shipped architecture.

Shapes are deliberately not our presets: grouped-query attention everywhere, a head width that
is not hidden/heads where the architecture allows it, ``rope_scaling`` of type ``llama3``, tied
embeddings (SmolLM), q/k/v biases (Qwen2), a sliding window longer than the test sequences
(Mistral). Every shape divides tp=2 (heads, kv heads, ffn, vocab) and pp=2 x 2 stages (layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = {
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    # Larger than transformers' 0.02, so that a wrong mapping or formula shows in the logits.
    "initializer_range": 0.1,
}

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        {
            "rope_theta": 50000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            "head_dim": 16,
        },
    ),
    "smollm": ("LlamaConfig", {"tie_word_embeddings": True, "rope_theta": 10000.0}),
    "mistral": ("MistralConfig", {"sliding_window": 128, "rope_theta": 1000000.0}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1000000.0, "tie_word_embeddings": False}),
}

# Mixture-of-experts architectures (the ``moe`` family), apart from the llama family's above.
MOE_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "rope_theta": 1000000.0,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": True,
        },
    )
}


def save_random_model(
    name: str, directory: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Any:
    """Build the named architecture with random weights, save it (safetensors) and return the model;
    ``overrides`` replace keys of its configuration (``tie_word_embeddings=True``)."""
    import transformers

    config_class, extra = {**ARCHITECTURES, **MOE_ARCHITECTURES}[name]
    config = getattr(transformers, config_class)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def reference_logits(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()
