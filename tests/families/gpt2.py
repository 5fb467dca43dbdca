"""A GPT-2-style family, written as a user would write one outside meshpilot.

    meshpilot train configs/tiny-3d.yaml --set model.family=tests.families.gpt2:Gpt2Family

Learned token and position embeddings, pre-LayerNorm blocks (with biases), causal multi-head
attention without rotary embeddings, a two-matrix GELU MLP, a final LayerNorm and an untied
output projection. It shares no code with the shipped ``llama`` family; only the protocol in
``workers.models.family``.

Tensor parallelism is Megatron's without sequence parallelism: q/k/v and ``fc`` are split by
output columns, ``out`` and ``proj`` by input rows (their outputs all-reduced), and the
embeddings and LayerNorms stay whole on every TP rank (sharded by FSDP only). The output
projection returns logits sharded over the vocabulary, the layout the trainer's
``loss_parallel`` reads.

Its shape is ``Gpt2Args``, a ``ModelSpec`` of its own: the planner counts this block (position
embedding, every bias, LayerNorms with their biases, a two-matrix MLP), and the config checks
refuse the keys it has no use for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from workers.models.family import InitRule, ModelFamily, StageModel, TensorParallelPlan
from workers.spec import PRESETS, ModelSpec

FAMILY_NAME = "gpt2-test"


@dataclass(frozen=True)
class Gpt2Args(ModelSpec):
    """A GPT-2-style decoder's shape and counts (torch-free, as the planner reads it). No field of
    its own: ``ffn_dim`` is the MLP's width and ``n_kv_heads`` must equal ``n_heads``."""

    @property
    def attention_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Two LayerNorms, q/k/v and ``out`` with their biases, ``fc`` and ``proj`` with theirs."""
        width = self.attention_width
        norms = 2 * 2 * self.dim
        attention = 3 * (self.dim * width + width) + width * self.dim + self.dim
        mlp = self.dim * self.ffn_dim + self.ffn_dim + self.ffn_dim * self.dim + self.dim
        return norms + attention + mlp

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings."""
        return (self.vocab_size + self.max_seq_len) * self.dim

    @property
    def head_params(self) -> int:
        """The final LayerNorm (weight and bias) and the untied output projection."""
        return 2 * self.dim + self.vocab_size * self.dim

    def saved_activations_per_token(self) -> int:
        """LayerNorm inputs and outputs (4h), q, k, v and the attention output (4 x width), the
        MLP's ``fc`` output and its GELU (2 x ffn)."""
        return 4 * self.dim + 4 * self.attention_width + 2 * self.ffn_dim

    def problems(self) -> list[str]:
        found = super().problems()
        if not found and self.n_kv_heads != self.n_heads:
            found.append(
                f"model.n_kv_heads={self.n_kv_heads} must equal model.n_heads={self.n_heads}: "
                f"{FAMILY_NAME} has no grouped-query attention (leave model.n_kv_heads unset)"
            )
        return found


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: Gpt2Args) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        width = spec.n_heads * spec.head_dim
        self.q = nn.Linear(spec.dim, width)
        self.k = nn.Linear(spec.dim, width)
        self.v = nn.Linear(spec.dim, width)
        self.out = nn.Linear(width, spec.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds n_heads / tp of them.
        q, k, v = (proj(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, seq_len, -1))


class Mlp(nn.Module):
    def __init__(self, spec: Gpt2Args) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.dim, spec.ffn_dim)
        self.proj = nn.Linear(spec.ffn_dim, spec.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec: Gpt2Args) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.dim, eps=spec.norm_eps)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = nn.LayerNorm(spec.dim, eps=spec.norm_eps)
        self.mlp = Mlp(spec)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class Gpt2(StageModel):
    """The whole model, or one pipeline stage of it (``StageModel.keep_only``)."""

    first_stage_modules = ("wte", "wpe")
    last_stage_modules = ("ln_f", "lm_head")

    def __init__(self, spec: Gpt2Args) -> None:
        super().__init__()
        self.wte: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.dim)
        self.wpe: nn.Embedding | None = nn.Embedding(spec.max_seq_len, spec.dim)
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in range(spec.n_layers)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(spec.dim, eps=spec.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(spec.dim, spec.vocab_size, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.wte is not None and self.wpe is not None, "only the first stage embeds"
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.wte(tokens) + self.wpe(positions)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.ln_f is not None and self.lm_head is not None, "only the last stage has the head"
        return self.lm_head(self.ln_f(hidden))


# Replicated activations between blocks; only the matrices of attention and MLP are split.
# ``lm_head`` keeps its logits sharded over the vocabulary (a DTensor placed Shard(-1)).
_TOP_PLAN: dict[str, ParallelStyle] = {
    "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
}
_LAYER_PLAN: dict[str, ParallelStyle] = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.out": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}


class Gpt2Family(ModelFamily[Gpt2Args]):
    """GPT-2-style decoders (see the module docstring); no Hugging Face import or export."""

    name = FAMILY_NAME
    args_class = Gpt2Args

    def preset(self, name: str) -> Gpt2Args:
        """The preset's width and depth with GPT-2's block: as many k/v heads as query heads,
        a 4 x dim two-matrix MLP, biases everywhere, learned positions."""
        base = PRESETS[name]
        return Gpt2Args(
            dim=base.dim,
            n_layers=base.n_layers,
            n_heads=base.n_heads,
            n_kv_heads=base.n_heads,
            vocab_size=base.vocab_size,
            ffn_dim=4 * base.dim,
            norm_eps=base.norm_eps,
            max_seq_len=base.max_seq_len,
        )

    def build(self, spec: Gpt2Args) -> Gpt2:
        return Gpt2(spec)

    def tensor_parallel_plan(self, spec: Gpt2Args) -> TensorParallelPlan:
        return TensorParallelPlan(top=_TOP_PLAN, layer=_LAYER_PLAN)

    def init_rule(self, fqn: str, spec: Gpt2Args) -> InitRule:
        """GPT-2's: weights normal(0.02), the residual branches' last projections scaled down
        by sqrt(2 * n_layers), LayerNorms at weight 1 and bias 0, every bias 0."""
        if fqn.endswith(".bias"):
            return InitRule.fill(0.0)
        if fqn.startswith("ln_f.") or fqn.endswith(("ln_1.weight", "ln_2.weight")):
            return InitRule.fill(1.0)
        if fqn.endswith(("attn.out.weight", "mlp.proj.weight")):
            return InitRule.normal(0.02 / (2 * spec.n_layers) ** 0.5)
        return InitRule.normal(0.02)
