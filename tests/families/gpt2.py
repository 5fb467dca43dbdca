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

The planner counts ``ModelSpec``'s Llama-style decoder with this family's MLP width, matrix
count and q/k/v biases; it leaves out the position embedding (``max_seq_len x dim``) and the
biases of ``out``, ``fc``, ``proj`` and the LayerNorms.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from workers.models.family import InitRule, ModelFamily, StageModel, TensorParallelPlan
from workers.spec import PRESETS, ModelSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
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
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.dim, spec.ffn_dim)
        self.proj = nn.Linear(spec.ffn_dim, spec.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
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

    def __init__(self, spec: ModelSpec) -> None:
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


class Gpt2Family(ModelFamily):
    """GPT-2-style decoders (see the module docstring); no Hugging Face import or export."""

    name = "gpt2-test"

    def preset(self, name: str) -> ModelSpec:
        """The preset's width and depth with GPT-2's block: as many k/v heads as query heads,
        a 4 x dim two-matrix MLP, biases everywhere, learned positions."""
        base = PRESETS[name]
        return dataclasses.replace(base, n_kv_heads=base.n_heads, ffn_dim=4 * base.dim, qkv_bias=True, mlp_matrices=2)

    def build(self, spec: ModelSpec) -> Gpt2:
        return Gpt2(spec)

    def tensor_parallel_plan(self, spec: ModelSpec) -> TensorParallelPlan:
        return TensorParallelPlan(top=_TOP_PLAN, layer=_LAYER_PLAN)

    def init_rule(self, fqn: str, spec: ModelSpec) -> InitRule:
        """GPT-2's: weights normal(0.02), the residual branches' last projections scaled down
        by sqrt(2 * n_layers), LayerNorms at weight 1 and bias 0, every bias 0."""
        if fqn.endswith(".bias"):
            return InitRule.fill(0.0)
        if fqn.startswith("ln_f.") or fqn.endswith(("ln_1.weight", "ln_2.weight")):
            return InitRule.fill(1.0)
        if fqn.endswith(("attn.out.weight", "mlp.proj.weight")):
            return InitRule.normal(0.02 / (2 * spec.n_layers) ** 0.5)
        return InitRule.normal(0.02)

    def problems(self, spec: ModelSpec) -> list[str]:
        found = super().problems(spec)
        if spec.n_kv_heads != spec.n_heads:
            found.append(
                f"model.n_kv_heads={spec.n_kv_heads} must equal model.n_heads={spec.n_heads}: "
                f"{self.name} has no grouped-query attention (leave model.n_kv_heads unset)"
            )
        if not spec.qkv_bias or spec.mlp_matrices != 2:
            found.append(f"{self.name} always has q/k/v biases and a two-matrix MLP (leave model.qkv_bias unset)")
        return found
