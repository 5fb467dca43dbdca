"""The ``llama`` family's args: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Torch-free: read by the planner and the config checks on the driver, and handed to every rank,
which builds ``workers.models.llama`` from it. Covers Llama 2/3.x, Mistral (within its sliding
window), Qwen2/2.5 (q/k/v biases) and the SmolLM-class models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.spec.model import ModelSpec


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequency scaling (Hugging Face ``rope_scaling`` of type ``llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaArgs(ModelSpec):
    """A Llama-style decoder's shape and counts: per layer two RMSNorms, grouped-query attention
    (q/k/v/o projections, q/k/v biases for Qwen2) and a three-matrix SwiGLU MLP; an untied output
    projection after the final norm (a checkpoint's tied embedding loads into both)."""

    rope_theta: float = 500000.0
    # Biases on the q/k/v projections (Qwen2).
    qkv_bias: bool = False
    # The checkpoint this shape came from ties its output projection to the input embedding.
    # Loaded untied: the output projection starts as a copy of the embedding and trains apart.
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    # Attention window of the checkpoint's architecture (Mistral): the model attends to every
    # earlier position, which is the same model only for sequences no longer than this.
    sliding_window: int | None = None

    # ------------------------------------------------------------ counting
    @property
    def attention_and_norm_params(self) -> int:
        """One layer's attention (with its q/k/v biases) and its two RMSNorms."""
        q_and_o = 2 * self.dim * self.n_heads * self.head_dim
        k_and_v = 2 * self.dim * self.n_kv_heads * self.head_dim
        biases = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
        norms = 2 * self.dim
        return q_and_o + k_and_v + biases + norms

    @property
    def feed_forward_params_per_layer(self) -> int:
        """One layer's SwiGLU MLP: gate, up and down projections."""
        return 3 * self.dim * self.ffn_dim

    @property
    def params_per_layer(self) -> int:
        return self.attention_and_norm_params + self.feed_forward_params_per_layer

    def adapter_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The attention projections and the SwiGLU MLP's three."""
        return {
            **super().adapter_linear_shapes(),
            "gate_proj": (self.dim, self.ffn_dim),
            "up_proj": (self.dim, self.ffn_dim),
            "down_proj": (self.ffn_dim, self.dim),
        }

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """The untied output projection and the final RMSNorm."""
        return self.vocab_size * self.dim + self.dim

    # ------------------------------------------------------------ memory
    def saved_activations_per_token(self) -> int:
        """Bf16 values one token keeps in one layer for backward (flash attention).

        Attention: RMSNorm input and output (2h), q (h), k and v (2·kv), the attention output that
        also feeds wo (h). Feed-forward: RMSNorm input and output (2h), then ``feed_forward_activations``.
        """
        kv_dim = self.n_kv_heads * self.head_dim
        return 2 * self.dim + self.dim + 2 * kv_dim + self.dim + 2 * self.dim + self.feed_forward_activations()

    def feed_forward_activations(self) -> int:
        """The MLP's saved values per token: w1 and w3 outputs, silu(w1) and the product feeding w2."""
        return 4 * self.ffn_dim

    # ------------------------------------------------------------ validation
    def head_problems(self) -> list[str]:
        found = super().head_problems()
        if not found and self.head_dim % 2:
            found.append(f"the head width {self.head_dim} must be even for rotary embeddings")
        return found

    def sequence_problems(self, seq_len: int) -> list[str]:
        found = super().sequence_problems(seq_len)
        if self.sliding_window is not None and seq_len > self.sliding_window:
            found.append(
                f"training.seq_len={seq_len} exceeds the model's sliding_window={self.sliding_window}: meshpilot "
                "attends to every earlier position, the same model only within the window; lower training.seq_len"
            )
        return found

    @classmethod
    def decode_fields(cls, values: dict[str, Any]) -> dict[str, Any]:
        if isinstance(values.get("rope_scaling"), dict):
            values = {**values, "rope_scaling": RopeScaling(**values["rope_scaling"])}
        return values
