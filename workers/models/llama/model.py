"""The ``llama`` family's modules: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Builds Llama 2/3.x (with ``rope_scaling`` of type ``llama3``), Mistral (within its sliding
window), Qwen2/2.5 (q/k/v biases) and the SmolLM-class models from ``LlamaArgs``. Runs on every
rank (and on the driver on the meta device, to learn parameter names and shapes).

Parameter names are those of Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix,
and rotary embeddings use the same rotate-half convention, so import and export are a rename
and nothing else. A pipeline stage is this same class with the parts it does not own removed
(``StageModel.keep_only``). Head counts are read from the projection shapes at run time
(``-1`` in views), because under tensor parallelism each rank holds ``n_heads / tp`` heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.context_parallel import WHOLE_SEQUENCE, SequenceShard
from workers.models.family import StageModel
from workers.spec.families import LlamaArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


def rotary_inv_freq(spec: LlamaArgs, device: torch.device) -> torch.Tensor:
    """Rotary frequencies, with Llama 3.1's scaling when the spec has it (as Hugging Face computes them)."""
    head_dim = spec.head_dim
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_cos_sin(
    spec: LlamaArgs, seq_len: int, device: torch.device, dtype: torch.dtype, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos/sin [..., seq, head_dim] at ``positions`` [..., seq] (``0 .. seq_len - 1`` when
    None; the positions of this rank's tokens when the sequence is split over cp ranks; per row,
    restarting at each document, when packed by documents)."""
    inv_freq = rotary_inv_freq(spec, device)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    positions = positions.to(torch.float32)
    freqs = positions[..., None] * inv_freq  # one product per element, as torch.outer and HF's matmul
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim], or [batch, 1, seq, head_dim]."""
    return x * cos + _rotate_half(x) * sin


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, [batch, seq], from document numbers [batch, seq]
    (runs of equal numbers, see ``workers.data.Sample``): 0 at each document's first token."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=-1).values
    return index - first


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, causal.

    ``sequence_shard`` (set by ``workers.parallelize.apply_context_parallel``) says which part of
    each sequence this rank holds when cp > 1: rotary embeddings use its global positions and
    the shard's ``attend`` makes attention span the whole sequence (by ``parallelism.cp_method``).
    """

    def __init__(self, spec: LlamaArgs) -> None:
        super().__init__()
        self.spec = spec
        self.sequence_shard: SequenceShard = WHOLE_SEQUENCE
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(spec.dim, spec.n_heads * spec.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.dim, spec.n_kv_heads * spec.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.n_heads * spec.head_dim, spec.dim, bias=False)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents`` [batch, whole seq] (packing by documents): positions restart and attention
        stops at each document; the whole sequence's even when cp splits ``x``."""
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        shard = self.sequence_shard
        positions = shard.positions(seq_len, x.device) if shard.split else None
        if documents is not None:
            positions = document_positions(documents)[:, shard.positions(seq_len, x.device)]
        cos, sin = rotary_cos_sin(self.spec, seq_len, x.device, q.dtype, positions)
        if cos.dim() == 3:  # per row: [batch, seq, head_dim] -> broadcast over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(shard.attend(q, k, v, documents).transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: LlamaArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.dim, spec.ffn_dim, bias=False)
        self.up_proj = nn.Linear(spec.dim, spec.ffn_dim, bias=False)
        self.down_proj = nn.Linear(spec.ffn_dim, spec.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention then pre-norm MLP, each residual; ``make_mlp`` builds the MLP (a
    family with another feed-forward, such as a mixture of experts, passes its own)."""

    def __init__(self, spec: LlamaArgs, make_mlp: Callable[[LlamaArgs], nn.Module] = FeedForward) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.dim, spec.norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.dim, spec.norm_eps)
        self.mlp = make_mlp(spec)

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        # documents by keyword: the tensor-parallel plan prepares the attention's positional input only.
        h = h + self.self_attn(self.input_layernorm(h), documents=documents)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(StageModel):
    """The whole model, or one pipeline stage of it (see ``StageModel.keep_only``)."""

    first_stage_modules = ("embed_tokens",)
    last_stage_modules = ("norm", "lm_head")

    def __init__(self, spec: LlamaArgs, make_mlp: Callable[[LlamaArgs], nn.Module] = FeedForward) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, make_mlp) for i in range(spec.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.dim, spec.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(spec.dim, spec.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first stage embeds"
        return self.embed_tokens(tokens)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.norm is not None and self.lm_head is not None, "only the last stage has the head"
        return self.lm_head(self.norm(hidden))
