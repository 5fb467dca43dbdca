"""DeepSpeed-Ulysses: an all-to-all trades the sequence split for a head split, attention runs
over the whole sequence, and a second all-to-all trades back (``parallelism.cp_method: ulysses``).

Runs on every rank of a cp group, called by ``SequenceShard.attend``; every cp rank calls it
for every attention layer, in the same order (each call is two collectives forward and two
backward).

Shapes, for ``cp`` ranks, ``h`` query heads and ``g`` key/value heads on this rank (after tp):
queries ``[b, h, S / cp, d]`` (this rank's two load-balanced chunks) become ``[b, h / cp, S, d]``
(heads ``j * h / cp ..`` of the whole sequence on cp rank ``j``), attention runs there under the
whole sequence's causal (or document) mask, and the result goes back to ``[b, h, S / cp, d]``.
The whole sequence arrives in the chunk order the ranks hold it; it is put back in global order
before attention, so a run without document masks keeps the ``is_causal`` kernel (flash on GPU).

Grouped key/value heads: ``g`` divisible by ``cp`` splits like the queries. Fewer key/value heads
than cp ranks, with ``g`` dividing ``cp``, are repeated ``cp / g`` times before the exchange, so
cp rank ``j`` receives the one key/value head its queries use (``j * g / cp``); the backward sums
the copies' gradients. Any other ``g`` is refused by the config check
(``orchestrator.config_checks``, the rule ``elastic.spec.ulysses_heads_problem``) and, should one
reach here, by ``ulysses_attention`` itself.

gloo and NCCL both implement ``all_to_all_single`` (gloo since torch 1.8), so one path serves
CPU and GPU; its backward is the same all-to-all of the gradients (``_AllToAll``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic.spec import ulysses_heads_problem

if TYPE_CHECKING:
    from workers.context_parallel import SequenceShard


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, documents: torch.Tensor | None
) -> torch.Tensor:
    """See ``SequenceShard.attend`` for the arguments and the result. Collective over
    ``shard.group`` (every cp rank calls it)."""
    from workers.context_parallel import WHOLE_SEQUENCE, document_mask, local_attention

    cp = shard.cp
    problem = ulysses_heads_problem(n_heads=q.shape[1], n_kv_heads=k.shape[1], tp=1, cp=cp)
    if problem is not None:
        raise ValueError(f"cp_method ulysses: {problem}; choose another cp or cp_method ring/allgather")
    if k.shape[1] < cp:  # each rank's queries need one of these key/value heads: repeat it per rank
        repeats = cp // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    whole_q, whole_k, whole_v = (_to_heads(tensor, shard) for tensor in (q, k, v))
    mask = None if documents is None else document_mask(documents, WHOLE_SEQUENCE)  # whole sequence, global order
    out = local_attention(whole_q, whole_k, whole_v, mask)
    return _to_sequence(out, shard)


def _to_heads(tensor: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """[b, heads, S / cp, d] of this rank's chunks -> [b, heads / cp, S, d] in global order."""
    cp = shard.cp
    batch, heads, local_len, dim = tensor.shape
    # Row j of the send buffer is the head group cp rank j attends for.
    send = tensor.reshape(batch, cp, heads // cp, local_len, dim).transpose(0, 1)
    received = _AllToAll.apply(send.contiguous(), shard.group)  # row r: cp rank r's chunks, my heads
    ordered: list[torch.Tensor | None] = [None] * (2 * cp)
    for cp_rank, part in enumerate(received.unbind(0)):
        ordered[cp_rank], ordered[2 * cp - 1 - cp_rank] = part.chunk(2, dim=2)
    return torch.cat([chunk for chunk in ordered if chunk is not None], dim=2)


def _to_sequence(tensor: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """[b, heads / cp, S, d] in global order -> [b, heads, S / cp, d] of this rank's chunks."""
    cp = shard.cp
    chunks = tensor.chunk(2 * cp, dim=2)
    # Row r of the send buffer is what cp rank r holds of the sequence: its two chunks.
    send = torch.stack([torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=2) for r in range(cp)])
    received = _AllToAll.apply(send, shard.group)  # row j: head group j of my chunks
    batch, heads, local_len, dim = received.shape[1:]
    return received.transpose(0, 1).reshape(batch, cp * heads, local_len, dim)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over ``group`` of a [group size, ...] tensor: row j goes to rank j,
    row r of the result came from rank r. Its own inverse, so the backward is the same exchange
    of the gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        received = torch.empty_like(tensor)
        dist.all_to_all_single(received, tensor, group=group)
        return received

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grads[0].contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received, None
