"""The shapes ``model.preset`` and ``meshpilot plan --model`` name: plain values, no torch."""

from __future__ import annotations

import dataclasses

from workers.spec.families import LlamaArgs, MoeArgs
from workers.spec.model import ModelSpec

PRESETS: dict[str, ModelSpec] = {
    # Small enough for 8 CPU ranks on 2 cores; byte-level vocabulary for the text demo.
    "debug": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=2048),
    # Llama 3.2 1B shape (that release ties input and output embeddings; ours are untied).
    "llama3-1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192),
    "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "llama3-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "llama3-405b": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248),
    # ``debug`` with a mixture of experts in every layer: 8 experts, top-2, one gated shared expert.
    "debug-moe": MoeArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        ffn_dim=192,
        max_seq_len=2048,
        n_experts=8,
        top_k_experts=2,
        moe_ffn_dim=64,
        n_shared_experts=1,
        shared_expert_ffn_dim=128,
        router_aux_loss_coef=0.01,
    ),
}


def model_spec(preset: str, **overrides) -> ModelSpec:
    """The preset's shape with any non-None field overridden (fields of the preset's family only)."""
    base = PRESETS[preset]
    changes = {key: value for key, value in overrides.items() if value is not None}
    return dataclasses.replace(base, **changes)
