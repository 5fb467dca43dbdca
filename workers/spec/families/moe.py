"""The ``moe`` family's args: llama's attention with a routed mixture of experts as every MLP.

Torch-free: read by the planner and the config checks on the driver, and handed to every rank,
which builds ``workers.models.moe`` from it (Qwen2-MoE, the ``debug-moe`` preset). A layer's
feed-forward is a router (one logit per expert), ``n_experts`` SwiGLU experts of which each token
reaches ``top_k_experts`` (dropless), and optionally one gated SwiGLU of the shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.spec.families.llama import LlamaArgs
from workers.spec.model import ModelSpec

# How a router turns its logits into expert scores.
ROUTER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoeArgs(LlamaArgs):
    """A mixture-of-experts decoder's shape: llama's, plus the experts (see the module docstring).

    ``ffn_dim`` is the width of a routed expert unless ``moe_ffn_dim`` says otherwise."""

    family: str = "moe"
    # Routed experts per layer.
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
    def expert_ffn_dim(self) -> int:
        """Hidden width of one routed expert."""
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def shared_ffn_dim(self) -> int:
        """Hidden width of the shared experts' MLP (0 without shared experts)."""
        if not self.n_shared_experts:
            return 0
        return self.shared_expert_ffn_dim or self.n_shared_experts * self.expert_ffn_dim

    # ------------------------------------------------------------ counting
    def _feed_forward_params(self, routed_experts: int) -> int:
        """The router, ``routed_experts`` experts, and the shared experts with their gate."""
        router = self.n_experts * self.dim
        shared = 3 * self.dim * self.shared_ffn_dim + (self.dim if self.n_shared_experts else 0)
        return router + routed_experts * 3 * self.dim * self.expert_ffn_dim + shared

    def adapter_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """The attention projections only: the experts' MLPs are routed, not adapted."""
        return ModelSpec.adapter_linear_shapes(self)

    @property
    def feed_forward_params_per_layer(self) -> int:
        """One layer's whole MoE block: router, every expert, shared experts."""
        return self._feed_forward_params(self.n_experts)

    @property
    def active_params_per_layer(self) -> int:
        """Attention, norms, router, shared experts, and the top-k routed experts a token reaches."""
        return self.attention_and_norm_params + self._feed_forward_params(self.top_k_experts)

    # ------------------------------------------------------------ memory
    def feed_forward_activations(self) -> int:
        """The SwiGLU values (4 per hidden unit) of each of the top-k experts and the shared ones,
        plus the k copies of the token sent to the experts and the k outputs combined (2·k·h)."""
        k = self.top_k_experts
        return 4 * (k * self.expert_ffn_dim + self.shared_ffn_dim) + 2 * k * self.dim

    # ------------------------------------------------------------ parallelism
    @property
    def tp_split_ffn_dim(self) -> int | None:
        """None: the block stays whole on every tp rank (each takes its own tokens through it)."""
        return None

    @property
    def tp_whole_params_per_layer(self) -> int:
        return self.feed_forward_params_per_layer

    @property
    def expert_params_per_layer(self) -> int:
        return self.n_experts * 3 * self.dim * self.expert_ffn_dim

    @property
    def experts_per_token(self) -> int:
        return self.top_k_experts

    def splits_experts(self, ep: int) -> bool:
        return self.n_experts % ep == 0

    def expert_parallel_problem(self, ep: int, key: str) -> str | None:
        if self.splits_experts(ep):
            return None
        return (
            f"{key}={ep} must divide model.n_experts={self.n_experts} so that every rank holds as many experts; "
            "choose an ep that divides it"
        )

    # ------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        found = super().problems()
        if self.n_experts < 1:
            return [*found, "model.n_experts must be >= 1 for model.family=moe (or use model.family=llama)"]
        if not 1 <= self.top_k_experts <= self.n_experts:
            found.append(f"model.top_k_experts={self.top_k_experts} must lie in 1..model.n_experts={self.n_experts}")
        if self.router_score not in ROUTER_SCORES:
            found.append(f"model.router_score={self.router_score!r} must be one of {', '.join(ROUTER_SCORES)}")
        if self.n_shared_experts < 0 or self.router_aux_loss_coef < 0:
            found.append("model.n_shared_experts and model.router_aux_loss_coef must be >= 0")
        if self.router_bias_update_rate < 0:
            found.append(f"model.router_bias_update_rate={self.router_bias_update_rate} must be >= 0 (0: no bias)")
        return found

    def init_from_problems(self) -> list[str]:
        if self.router_bias_update_rate <= 0:
            return []
        return [
            f"model.router_bias_update_rate={self.router_bias_update_rate} with model.init_from: "
            "released Hugging Face MoE weights hold no routing bias to start it from; set "
            "model.router_bias_update_rate=0 (and balance with model.router_aux_loss_coef)"
        ]
