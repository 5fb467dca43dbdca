"""Shapes of a decoder-only model: plain values shared by the driver, the planner and the ranks.

No torch here: the planner sizes a 405B model from these numbers on a laptop, and the driver
validates a config without importing the model. ``family`` names the code that builds the
model from these shapes (``workers.models``): a registered name or ``package.module:Class``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face ``rope_scaling`` of type ``llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


# ModelSpec fields a checkpoint's model description holds only when they differ from their default.
RECORDED_WHEN_SET = (
    "family",
    "attention_head_dim",
    "qkv_bias",
    "tie_embeddings",
    "rope_scaling",
    "sliding_window",
    "mlp_matrices",
    "n_experts",
    "top_k_experts",
    "moe_ffn_dim",
    "n_shared_experts",
    "shared_expert_ffn_dim",
    "router_score",
    "normalize_top_k",
    "router_aux_loss_coef",
    "router_bias_update_rate",
)

# How a router turns its logits into expert scores.
ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. The counting below is the Llama-style decoder's
    (RMSNorm, RoPE, SwiGLU, grouped-query attention); a family with another block says so
    through ``mlp_matrices`` and the bias flags."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    family: str = "llama"
    # Width of one attention head when it is not dim / n_heads (Hugging Face's ``head_dim``).
    attention_head_dim: int | None = None
    # Biases on the q/k/v projections (Qwen2).
    qkv_bias: bool = False
    # The checkpoint this shape came from ties its output projection to the input embedding.
    # Loaded untied: the output projection starts as a copy of the embedding and trains apart.
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    # Attention window of the checkpoint's architecture (Mistral): the model attends to every
    # earlier position, which is the same model only for sequences no longer than this.
    sliding_window: int | None = None
    # Weight matrices per feed-forward block: 3 for SwiGLU, 2 for a plain MLP.
    mlp_matrices: int = 3
    # Mixture of experts (the ``moe`` family): routed experts per layer, 0 for a dense model.
    n_experts: int = 0
    # Routed experts each token goes to (top-k); every token reaches all k (no token dropping).
    top_k_experts: int = 0
    # Hidden width of one routed expert's SwiGLU MLP; None = ffn_dim.
    moe_ffn_dim: int | None = None
    # Shared experts every token passes through (one SwiGLU MLP with a sigmoid gate, as Qwen2-MoE).
    n_shared_experts: int = 0
    # Hidden width of the shared experts together; None = n_shared_experts * the routed expert width.
    shared_expert_ffn_dim: int | None = None
    router_score: str = "softmax"
    # Rescale each token's top-k scores to sum to one (Hugging Face's ``norm_topk_prob``).
    normalize_top_k: bool = False
    # Weight of the load-balancing auxiliary loss (Switch Transformer's, per layer) in the gradient.
    router_aux_loss_coef: float = 0.001
    # Auxiliary-loss-free balancing (DeepSeek-V3): after every step each expert's routing bias moves
    # by this much towards the mean load (down when overloaded, up when underloaded); 0: off.
    router_bias_update_rate: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def tp_split_ffn_dim(self) -> int | None:
        """The MLP width tensor parallelism splits: None for a mixture of experts, whose block
        stays whole on every tp rank (each takes its own tokens through it)."""
        return None if self.is_moe else self.ffn_dim

    @property
    def expert_ffn_dim(self) -> int:
        """Hidden width of one routed expert."""
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def shared_ffn_dim(self) -> int:
        """Hidden width of the shared experts' MLP (0 without shared experts)."""
        if not self.n_shared_experts:
            return 0
        return self.shared_expert_ffn_dim or self.n_shared_experts * self.expert_ffn_dim

    def to_dict(self) -> dict:
        """Plain JSON-able values (checkpoint manifests record them).

        Fields beyond the original Llama shape are left out while they hold their defaults, so
        a checkpoint written before they existed still compares equal to the same model now.
        """
        values = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in RECORDED_WHEN_SET and values[f.name] == f.default:
                del values[f.name]
        return values

    @classmethod
    def from_dict(cls, values: dict) -> ModelSpec:
        """The inverse of ``to_dict``; keys this version does not know are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        kept = {key: value for key, value in values.items() if key in known}
        if isinstance(kept.get("rope_scaling"), dict):
            kept["rope_scaling"] = RopeScaling(**kept["rope_scaling"])
        return cls(**kept)

    def problems(self) -> list[str]:
        """Every inconsistency of the shape itself, as sentences naming the keys."""
        found = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                found.append(f"model.{name}={getattr(self, name)} must be >= 1")
        if found:
            return found
        if self.attention_head_dim is None and self.dim % self.n_heads:
            found.append(f"model.n_heads={self.n_heads} must divide model.dim={self.dim}")
        elif self.head_dim % 2:
            found.append(f"the head width {self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            found.append(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        return found + self.moe_problems()

    def moe_problems(self) -> list[str]:
        """The mixture-of-experts fields (all unset for a dense model)."""
        if not self.is_moe:
            if self.top_k_experts or self.n_shared_experts:
                return ["model.top_k_experts and model.n_shared_experts need model.n_experts >= 1"]
            return []
        found = []
        if not 1 <= self.top_k_experts <= self.n_experts:
            found.append(f"model.top_k_experts={self.top_k_experts} must lie in 1..model.n_experts={self.n_experts}")
        if self.router_score not in ROUTER_SCORES:
            found.append(f"model.router_score={self.router_score!r} must be one of {', '.join(ROUTER_SCORES)}")
        if self.n_shared_experts < 0 or self.router_aux_loss_coef < 0:
            found.append("model.n_shared_experts and model.router_aux_loss_coef must be >= 0")
        if self.router_bias_update_rate < 0:
            found.append(f"model.router_bias_update_rate={self.router_bias_update_rate} must be >= 0 (0: no bias)")
        return found

    # ------------------------------------------------------------ counting
    @property
    def params_per_layer(self) -> int:
        """Every parameter of one layer (all experts of a mixture of experts)."""
        return self._attention_and_norm_params + self._feed_forward_params(self.n_experts)

    @property
    def active_params_per_layer(self) -> int:
        """The parameters of one layer a token is computed with (its top-k experts only)."""
        return self._attention_and_norm_params + self._feed_forward_params(self.top_k_experts)

    @property
    def feed_forward_params_per_layer(self) -> int:
        """One layer's MLP: a mixture of experts' whole block (router, every expert, shared experts)."""
        return self._feed_forward_params(self.n_experts)

    @property
    def _attention_and_norm_params(self) -> int:
        q_and_o = 2 * self.dim * self.n_heads * self.head_dim
        k_and_v = 2 * self.dim * self.n_kv_heads * self.head_dim
        biases = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
        norms = 2 * self.dim
        return q_and_o + k_and_v + biases + norms

    def _feed_forward_params(self, routed_experts: int) -> int:
        """A dense MLP, or the router, ``routed_experts`` experts and the gated shared experts."""
        if not self.is_moe:
            return self.mlp_matrices * self.dim * self.ffn_dim
        router = self.n_experts * self.dim
        shared = 3 * self.dim * self.shared_ffn_dim + (self.dim if self.n_shared_experts else 0)
        return router + routed_experts * 3 * self.dim * self.expert_ffn_dim + shared

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers, final norm, output projection (trained untied)."""
        return 2 * self.embedding_params + self.n_layers * self.params_per_layer + self.dim

    @property
    def num_active_params(self) -> int:
        """The parameters one token is computed with: ``num_params`` less the experts it skips."""
        return 2 * self.embedding_params + self.n_layers * self.active_params_per_layer + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the usual 6N plus attention scores.

        Embedding lookups do no matmul, so they are left out of N, as in the PaLM appendix; a
        mixture of experts counts the active parameters (top-k experts), not all of them.
        """
        dense = self.num_active_params - self.embedding_params
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6.0 * dense + attention


PRESETS: dict[str, ModelSpec] = {
    # Small enough for 8 CPU ranks on 2 cores; byte-level vocabulary for the text demo.
    "debug": ModelSpec(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=192, max_seq_len=2048),
    # Llama 3.2 1B shape (that release ties input and output embeddings; ours are untied).
    "llama3-1b": ModelSpec(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192),
    "llama3-8b": ModelSpec(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "llama3-70b": ModelSpec(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "llama3-405b": ModelSpec(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248),
    # ``debug`` with a mixture of experts in every layer: 8 experts, top-2, one gated shared expert.
    "debug-moe": ModelSpec(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        ffn_dim=192,
        max_seq_len=2048,
        family="moe",
        n_experts=8,
        top_k_experts=2,
        moe_ffn_dim=64,
        n_shared_experts=1,
        shared_expert_ffn_dim=128,
        router_aux_loss_coef=0.01,
    ),
}


def model_spec(preset: str, **overrides) -> ModelSpec:
    """The preset's shape with any non-None field overridden."""
    base = PRESETS[preset]
    changes = {key: value for key, value in overrides.items() if value is not None}
    return dataclasses.replace(base, **changes)
