"""A layer's routed experts as three stacked parameters, and their expert-parallel token exchange.

Runs on every rank, inside the ``moe`` family's forward and backward. The experts' SwiGLU
weights are stacked along a leading expert dimension (TorchTitan's ``GroupedExperts``):
``gate_proj`` and ``up_proj`` [n_experts, hidden, dim], ``down_proj`` [n_experts, dim, hidden];
expert ``e``'s slice ``[e]`` is the Hugging Face tensor ``mlp.experts.<e>.<name>.weight``.

Under expert parallelism (``parallelism.ep > 1``, set up by ``workers.parallelize.
apply_expert_parallel``) the stacked parameters are DTensors sharded ``Shard(0)`` over the ``ep``
sub-mesh of ``dp_shard``: each rank of an ep group holds ``n_experts / ep`` consecutive experts.
Every rank routes its own tokens; they are sent to the ranks that hold their experts with one
``all_to_all_single`` (uneven splits), computed there and sent back with a second one. Both
exchanges are autograd functions, so the backward pass sends the gradients the same way back.
Every rank of an ep group calls the exchanges in the same order (same layers, same microbatch
schedule), which is what a collective needs.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU experts, ``down(silu(gate(x)) * up(x))`` each, in stacked weights."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        # The ep group's communicator (``apply_expert_parallel``); None: this rank holds every expert.
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` sorted by expert, ``counts[e]`` of them for expert ``e`` (all experts): each
        token's expert output, in the same order. Collective over the ep group when ep > 1."""
        if self.ep_group is None:
            return self._compute(tokens, counts)
        return self._exchange_and_compute(tokens, counts, self.ep_group)

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's experts' weights (a DTensor's shard under expert parallelism)."""
        gate, up, down = (_local(getattr(self, name)) for name in EXPERT_WEIGHTS)
        return gate, up, down

    def _compute(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert over its consecutive run of ``tokens`` (one matmul per expert)."""
        gate, up, down = self._local_weights()
        outputs = [
            F.linear(F.silu(F.linear(chunk, gate[expert])) * F.linear(chunk, up[expert]), down[expert])
            for expert, chunk in enumerate(tokens.split(counts))
        ]
        return torch.cat(outputs) if outputs else tokens.new_empty(0, down.shape[1])

    def _exchange_and_compute(self, tokens: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        """Send each token to the rank of its expert, compute there, send the result back.

        Collective over ``group`` (the ep group): two ``all_to_all_single`` of token rows and one
        of the per-expert counts, so that each rank knows how many rows it receives.
        """
        ep = dist.get_world_size(group)
        local = self.n_experts // ep
        # On the tokens' device: NCCL exchanges device tensors only.
        sent_counts = torch.tensor(counts, dtype=torch.int64, device=tokens.device)
        received_counts = torch.empty_like(sent_counts)
        # Rank r receives, from every source, the counts of r's own experts: [source, local expert].
        dist.all_to_all_single(received_counts, sent_counts, group=group)
        # .cpu() is a device sync point: every all_to_all needs its split sizes on the host.
        sent_counts, by_source = sent_counts.cpu(), received_counts.cpu().view(ep, local)
        send_splits = sent_counts.view(ep, local).sum(1).tolist()
        receive_splits = by_source.sum(1).tolist()
        received = _all_to_all(tokens, receive_splits, send_splits, group)
        # Source-major as received; each expert's rows together for its one matmul, and back.
        source_major = by_source.flatten().tolist()
        expert_major = by_source.t().flatten().tolist()
        pieces = received.split(source_major)
        regrouped = torch.cat([pieces[source * local + expert] for expert in range(local) for source in range(ep)])
        computed = self._compute(regrouped, by_source.sum(0).tolist()).split(expert_major)
        returned = torch.cat([computed[expert * ep + source] for source in range(ep) for expert in range(local)])
        return _all_to_all(returned, send_splits, receive_splits, group)


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _all_to_all(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows ``input_splits[r]`` to rank ``r``, ``output_splits[r]`` from it; differentiable."""
    return cast(torch.Tensor, AllToAll.apply(rows, output_splits, input_splits, group))


def _exchange(
    rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    output = rows.new_empty(sum(output_splits), *rows.shape[1:])
    dist.all_to_all_single(output, rows.contiguous(), output_splits, input_splits, group=group)
    return output


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its backward sends the gradients back the
    way the rows came (the same exchange with the splits swapped), so every rank of the group runs
    it in the backward pass too."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange(rows, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _exchange(grad, input_splits, output_splits, ctx.group), None, None, None
