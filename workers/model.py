"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Runs on every rank (and in tests on one process). Parameter names are those of Hugging Face's
``LlamaForCausalLM`` without its ``model.`` prefix, and rotary embeddings use the same
rotate-half convention, so an export is a rename and nothing else.

A pipeline stage is this same class with the parts it does not own removed: the first stage
keeps ``embed_tokens``, the last keeps ``norm`` and ``lm_head``, each keeps its slice of
``layers`` (a ModuleDict keyed by the global layer index, so names never change with the
pipeline split).

Head counts are read from the projection shapes at run time (``-1`` in views), because under
tensor parallelism each rank holds ``n_heads / tp`` heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from workers.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.rope_theta = spec.rope_theta
        self.q_proj = nn.Linear(spec.dim, spec.n_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.n_heads * spec.head_dim, spec.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(seq_len, self.head_dim, self.rope_theta, x.device, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.dim, spec.ffn_dim, bias=False)
        self.up_proj = nn.Linear(spec.dim, spec.ffn_dim, bias=False)
        self.down_proj = nn.Linear(spec.ffn_dim, spec.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.dim, spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.dim, spec.norm_eps)
        self.mlp = FeedForward(spec)
        # Recompute this block's activations in the backward pass instead of keeping them.
        self.activation_checkpointing = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, h, use_reentrant=False)
        return self._forward(h)

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (see ``keep_only``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.dim, spec.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(spec.dim, spec.vocab_size, bias=False)

    def keep_only(self, layer_ids: range, *, first: bool, last: bool) -> Transformer:
        """Drop what a pipeline stage does not own; names of what stays are unchanged."""
        for layer_id in list(self.layers.keys()):
            if int(layer_id) not in layer_ids:
                del self.layers[layer_id]
        if not first:
            self.embed_tokens = None
        if not last:
            self.norm = None
            self.lm_head = None
        return self

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] on the first stage, hidden states [batch, seq, dim] after it.

        Returns logits [batch, seq, vocab] on the last stage, hidden states elsewhere.
        """
        h = self.embed_tokens(tokens_or_hidden) if self.embed_tokens is not None else tokens_or_hidden
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


def init_std(fqn: str, spec: ModelSpec) -> float | None:
    """Initial standard deviation of a weight; None for norm weights (initialised to ones).

    Output projections of each residual branch are scaled down by sqrt(2 * n_layers), as in
    GPT-2 and Llama's reference training code, so the residual stream does not grow with depth.
    """
    if fqn.endswith("layernorm.weight") or fqn == "norm.weight":
        return None
    if fqn.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / (2 * spec.n_layers) ** 0.5
    return 0.02
