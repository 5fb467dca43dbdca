"""The ``moe`` family's modules: the llama decoder with a routed mixture of experts as its feed-forward.

Builds Qwen2-MoE (``Qwen2MoeForCausalLM``) and the ``debug-moe`` preset from ``MoeArgs``. Runs on
every rank (and on the driver on the meta device, to learn parameter names and shapes).

Each layer's MLP is a router (``mlp.gate``, one logit per expert), ``n_experts`` SwiGLU experts
(``mlp.experts``, stacked: ``GroupedExperts``) and, optionally, a shared SwiGLU expert every
token passes through, scaled by a sigmoid gate (``mlp.shared_expert``, ``mlp.shared_expert_gate``)
as in Qwen2-MoE. Routing is top-k over softmax (or sigmoid) scores and dropless: every token is computed by each of its
``top_k_experts`` experts, whatever the load; no capacity factor, no token is ever dropped.

Load balancing is Switch Transformer's auxiliary loss, per layer and per microbatch:
``n_experts * sum_e(f_e * p_e)`` (``f_e``: the fraction of tokens routed to expert ``e``, ``p_e``:
its mean router probability), weighted by ``router_aux_loss_coef / n_layers``. Its gradient is
added to the training loss's in the backward pass (``AttachAuxiliaryLoss``), so it works
unchanged under pipelining and activation checkpointing; the reported loss is the cross
entropy alone. (Hugging Face averages ``f`` and ``p`` over all layers before the product; the
per-layer form is Megatron's and TorchTitan's, and needs nothing from other pipeline stages.)
Under context parallelism a rank holds part of every sequence: ``f_e`` is counted over the whole
microbatch (the cp ranks' counts summed), and each rank's ``p_e`` sum covers its own tokens, so
the gradients the cp ranks' FSDP averages are those of the one-process loss.

Under tensor parallelism the block takes its rank's sequence-parallel tokens (1/tp of each
sequence, as the norms hold them) and runs them through whole weights: no weight is split over
tp and no activation is gathered. Each tp rank's gradient then covers its own tokens, so the
block's weights are sharded by FSDP over the data and tensor ranks together and their
gradients summed over tp (``workers.parallelize.apply_whole_weight_fsdp``); ``f_e`` counts the
tp ranks' tokens too.

With ``router_bias_update_rate > 0`` the balance is DeepSeek-V3's auxiliary-loss-free one instead
(or as well): each layer holds a bias per expert (``mlp.expert_bias``, a parameter no gradient
trains) added to the scores for the top-k choice only; the gating weights stay the scores. After
every step each expert's bias moves by the rate towards the mean load: down when it took more
than the mean of the step's tokens (counted over every rank of the stage: data, cp and tp
ranks), up when fewer. Every rank applies the same update, so replicas stay bitwise equal and a
checkpoint holds the biases like any parameter. Qwen2-MoE has no such bias: such a model is
neither imported from nor exported to Hugging Face.

Parameter names are Hugging Face's without ``model.``, except the routed experts: a layer's
experts are three stacked parameters (``mlp.experts.gate_proj`` [n_experts, hidden, dim], ...,
see ``GroupedExperts``), which expert parallelism shards over the ``ep`` mesh. Each maps to
``n_experts`` Hugging Face tensors (``model.layers.<l>.mlp.experts.<e>.gate_proj.weight``, the
stacked parameter's slice ``[e]``), so import and export stack and unstack them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from checkpointing.torch_compat import local_shape_and_offset
from workers.context_parallel import WHOLE_SEQUENCE, SequenceShard
from workers.models.llama.model import Transformer
from workers.models.moe.grouped_experts import GroupedExperts
from workers.spec.families import MoeArgs


class SwiGLU(nn.Module):
    """The shared experts: ``down(silu(gate(x)) * up(x))`` (the routed ones are ``GroupedExperts``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttachAuxiliaryLoss(torch.autograd.Function):
    """Returns ``output`` unchanged; in the backward pass gives ``aux_loss`` the gradient ``scale``.

    That is the gradient of ``training loss + scale * aux_loss`` without the trainer knowing
    of the auxiliary loss (Megatron's ``MoEAuxLossAutoScaler``).
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class MixtureOfExperts(nn.Module):
    """Router, routed experts and the optional gated shared expert of one layer (dropless top-k)."""

    def __init__(self, spec: MoeArgs) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(spec.dim, spec.n_experts, bias=False)
        self.experts = GroupedExperts(spec.dim, spec.expert_ffn_dim, spec.n_experts)
        self.shared_expert = SwiGLU(spec.dim, spec.shared_ffn_dim) if spec.n_shared_experts else None
        self.shared_expert_gate = nn.Linear(spec.dim, 1, bias=False) if spec.n_shared_experts else None
        # Auxiliary-loss-free balancing's bias (moved by ``nudge_bias``, never by a gradient).
        balancing = spec.router_bias_update_rate > 0
        self.expert_bias = nn.Parameter(torch.zeros(spec.n_experts), requires_grad=False) if balancing else None
        # Tokens routed to each expert since the step began (on the device; with a bias only).
        self.routed_this_step: torch.Tensor | None = None
        # False during a pipeline stage's shape inference, a forward of no step (see ``StageModel``).
        self.counts_tokens = True
        # The trainer's 1 / (microbatches per step), as its loss is scaled (``scale_auxiliary_losses``).
        self.auxiliary_loss_scale = 1.0
        # Tokens routed to each expert in the last forward pass (top-k assignments, on the host).
        self.tokens_per_expert: torch.Tensor | None = None
        # The same, summed over the forward passes since ``MoeTransformer.expert_load`` last read it.
        self.routed_since_read: torch.Tensor | None = None
        # This rank's part of every sequence (set by ``workers.parallelize.apply_context_parallel``).
        self.sequence_shard: SequenceShard = WHOLE_SEQUENCE
        # The tp group whose ranks hold the other sequence-parallel tokens (set by
        # ``workers.parallelize.apply_tensor_parallel``; None: tp = 1).
        self.tensor_parallel_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            # The pipeline's shape inference runs forward on meta tensors, which hold no values
            # to route by; the block keeps the shape of its input.
            return torch.empty_like(x)
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.gate(tokens)
        scores = logits.float().softmax(-1) if self.spec.router_score == "softmax" else logits.float().sigmoid()
        if self.expert_bias is None:
            top_scores, top_experts = scores.topk(self.spec.top_k_experts, dim=-1)
        else:
            top_experts = (scores + self.expert_bias.float()).topk(self.spec.top_k_experts, dim=-1).indices
            top_scores = scores.gather(-1, top_experts)
        if self.spec.normalize_top_k:
            top_scores = top_scores / top_scores.sum(-1, keepdim=True)
        out = self.routed(x, top_experts, top_scores.to(tokens.dtype), scores)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
            out = out + shared.view_as(x)
        return out

    def routed(
        self, x: torch.Tensor, top_experts: torch.Tensor, weights: torch.Tensor, scores: torch.Tensor
    ) -> torch.Tensor:
        """Each token of ``x`` through each of its top-k experts, weighted and summed (every
        token, no capacity), with the load-balancing loss's gradient attached when training.

        Assignments are sorted by expert so that each expert runs one matmul over its tokens
        (on the rank that holds it, under expert parallelism: ``GroupedExperts``). The result
        is a new tensor of ``x``'s shape, not a view: FSDP2 hooks the backward of the block's
        output, which an in-place op on a view would bypass.
        """
        tokens = x.reshape(-1, x.shape[-1])
        flat_experts = top_experts.reshape(-1)
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.spec.n_experts)
        if self.counts_tokens:
            self._count(counts.detach())
        token_index = order // self.spec.top_k_experts
        # .tolist() is a device sync point: the split sizes are needed on the host.
        computed = self.experts(tokens[token_index], counts.tolist())
        weighted = computed * weights.reshape(-1)[order].unsqueeze(-1)
        if torch.is_grad_enabled() and self.spec.router_aux_loss_coef > 0:
            scale = self.spec.router_aux_loss_coef / self.spec.n_layers * self.auxiliary_loss_scale
            weighted = AttachAuxiliaryLoss.apply(weighted, self.load_balancing_loss(scores, counts), scale)
        out = x.new_zeros(x.shape)
        out.view(-1, x.shape[-1]).index_add_(0, token_index, weighted)
        return out

    def load_balancing_loss(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch Transformer's ``n_experts * sum_e(f_e * p_e)`` over this layer's tokens, with ``f_e``
        the fraction of tokens that chose expert ``e`` (as Hugging Face counts it): ``top_k`` when even.

        With cp > 1 or tp > 1 (collective over the cp and tp groups: all-reduces of the counts) the
        tokens are the whole microbatch's: ``f_e`` from every cp and tp rank's counts, and this
        rank's share of ``p_e``'s sum, times cp, since FSDP averages the cp ranks' gradients and
        sums the tp ranks' (its value is then not the loss; only its gradient is used, and it is
        the one-process gradient).
        """
        n_tokens = scores.shape[0]
        shard = self.sequence_shard
        groups = [shard.group] if shard.split else []
        if self.tensor_parallel_group is not None:
            groups.append(self.tensor_parallel_group)
        if groups:
            counts = counts.clone()
        for group in groups:
            dist.all_reduce(counts, group=group)
            n_tokens *= dist.get_world_size(group)
        fraction_routed = counts.to(torch.float32) / n_tokens
        probability_sums = (scores / scores.sum(-1, keepdim=True)).sum(0)
        return shard.cp * self.spec.n_experts * (fraction_routed * probability_sums).sum() / n_tokens

    def _count(self, counts: torch.Tensor) -> None:
        """Add one forward's tokens per expert to the load metrics and, training with a bias, the step's counts."""
        self.tokens_per_expert = counts.cpu()
        read = self.routed_since_read
        self.routed_since_read = self.tokens_per_expert if read is None else read + self.tokens_per_expert
        if self.expert_bias is not None and torch.is_grad_enabled():
            step = self.routed_this_step
            self.routed_this_step = counts if step is None else step + counts

    def nudge_bias(self, bias: torch.Tensor, routed: torch.Tensor) -> None:
        """Move this rank's slice of ``bias`` (the sharded ``expert_bias``) by the rate towards
        the mean load, given every rank's ``routed`` tokens per expert this step (float)."""
        step = self.spec.router_bias_update_rate * torch.sign(routed.mean() - routed)
        if isinstance(bias, DTensor):
            shape, offset = local_shape_and_offset(bias)
            step = step[offset[0] : offset[0] + shape[0]]
        local = bias.to_local() if isinstance(bias, DTensor) else bias.data
        local.add_(step.to(local.device, local.dtype))


class MoeTransformer(Transformer):
    """The llama decoder with a mixture of experts as every layer's MLP (the whole model, or one
    pipeline stage of it)."""

    def __init__(self, spec: MoeArgs) -> None:
        super().__init__(spec, make_mlp=lambda _: MixtureOfExperts(spec))

    def scale_auxiliary_losses(self, scale: float) -> None:
        for module in self.modules():
            if isinstance(module, MixtureOfExperts):
                module.auxiliary_loss_scale = scale

    def _balanced_layers(self) -> list[tuple[str, MixtureOfExperts]]:
        """(layer id, MoE block) of the layers this stage holds that balance by bias."""
        return [
            (layer_id, mlp)
            for layer_id, layer in self.layers.items()
            if isinstance(mlp := getattr(layer, "mlp", None), MixtureOfExperts) and mlp.expert_bias is not None
        ]

    def set_shape_inference(self, active: bool) -> None:
        for module in self.modules():
            if isinstance(module, MixtureOfExperts):
                module.counts_tokens = not active

    def start_step(self) -> None:
        for _, mlp in self._balanced_layers():
            mlp.routed_this_step = None

    def after_optimizer_step(
        self, parameters: Mapping[str, torch.Tensor], all_reduce: Callable[[torch.Tensor], None]
    ) -> None:
        """Collective (one all-reduce of every balanced layer's counts): nudge each layer's bias."""
        layers = self._balanced_layers()
        counted = [mlp.routed_this_step for _, mlp in layers]
        if not counted or any(count is None for count in counted):
            # Every layer of the stage routes every microbatch: all counted, or (no training
            # forward since the step began) none, alike on every rank of the stage.
            return
        routed = torch.stack([count.float() for count in counted if count is not None])
        all_reduce(routed)
        for (layer_id, mlp), layer_routed in zip(layers, routed):
            mlp.nudge_bias(parameters[f"layers.{layer_id}.mlp.expert_bias"], layer_routed)
            mlp.routed_this_step = None

    def expert_load(self) -> dict[str, float]:
        """Per layer this stage holds (``"layer<i>"``): the busiest expert's tokens over the mean
        expert's, over the forward passes since the last call (1.0: perfectly even; n_experts:
        every token on one expert). Activation checkpointing's recomputation counts every
        microbatch twice, which leaves the ratio unchanged."""
        load = {}
        for layer_id, layer in self.layers.items():
            mlp = getattr(layer, "mlp", None)
            if not isinstance(mlp, MixtureOfExperts) or mlp.routed_since_read is None:
                continue
            counts, mlp.routed_since_read = mlp.routed_since_read.float(), None
            if counts.sum() > 0:
                load[f"layer{layer_id}"] = round(float(counts.max() / counts.mean()), 4)
        return load
