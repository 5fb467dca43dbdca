"""Context parallelism: every sequence split over the ``cp`` ranks of a mesh, attention made whole.

Runs on every rank. A rank's ``SequenceShard`` says which part of each sequence it holds; the
trainer cuts inputs and labels with ``take`` and hands the shard to the model's attention
layers (``workers.parallelize.apply_context_parallel``), which read their tokens' global
positions (for rotary embeddings) and call ``attend`` with their queries, keys and values.
``attend`` makes attention whole by the shard's ``method`` (``elastic.spec.CpMethod``):
``allgather`` all-gathers keys and values over the cp group (``gather_sequence``), ``ring``
passes them around it (``workers.ring_attention``), ``ulysses`` trades the sequence split for a
head split (``workers.ulysses``).

Load-balanced causal sharding (Llama 3, TorchTitan): the sequence is cut into ``2 * cp`` equal
chunks and cp rank ``i`` keeps chunks ``i`` and ``2 * cp - 1 - i``. Under a causal mask a late
chunk attends to many keys and an early one to few; pairing them gives every rank the same work.

Packed by documents (``data.packing: documents``), a rank keeps the document numbers of the whole
sequence: its queries' rotary positions restart at their documents' starts, and its mask (global
positions, ``causal_mask``) also fences each query to keys of its own document
(``workers.models.llama.model.document_mask``).

``WHOLE_SEQUENCE`` is the null shard (cp = 1): positions ``0 .. seq - 1``, no communication, and
attention keeps its ``is_causal`` kernel, so a run without context parallelism is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic.spec import CpMethod


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of every sequence: chunks ``cp_rank`` and ``2 * cp - 1 - cp_rank`` of
    ``2 * cp``; ``group`` is the cp process group (None when cp = 1); ``method`` how attention
    spans the whole sequence."""

    cp: int = 1
    cp_rank: int = 0
    group: Any = None
    method: CpMethod = CpMethod.ALLGATHER

    @property
    def split(self) -> bool:
        """Whether sequences are split over several ranks (cp > 1)."""
        return self.cp > 1

    def _chunk_ids(self) -> tuple[int, int]:
        return self.cp_rank, 2 * self.cp - 1 - self.cp_rank

    def take(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of ``tensor``, whose ``dim`` is the whole sequence (no communication)."""
        if not self.split:
            return tensor
        chunks = tensor.chunk(2 * self.cp, dim=dim)
        return torch.cat([chunks[index] for index in self._chunk_ids()], dim=dim)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's ``local_len`` tokens, in the order it holds them."""
        if not self.split:
            return torch.arange(local_len, device=device)
        chunk = local_len // 2
        return torch.cat(
            [torch.arange(index * chunk, (index + 1) * chunk, device=device) for index in self._chunk_ids()]
        )

    def gather_sequence(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Collective over the cp group: every rank's part of ``tensor`` along ``dim``, in global
        sequence order. Autograd-correct: the backward sums each part's gradients from every
        rank and hands each rank its own (``_GatherParts``)."""
        if not self.split:
            return tensor
        parts = _GatherParts.apply(tensor.contiguous(), self.group).unbind(0)
        ordered: list[torch.Tensor | None] = [None] * (2 * self.cp)
        for cp_rank, part in enumerate(parts):
            early, late = part.chunk(2, dim=dim)
            ordered[cp_rank], ordered[2 * self.cp - 1 - cp_rank] = early, late
        return torch.cat([chunk for chunk in ordered if chunk is not None], dim=dim)

    def causal_mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """[local_len, local_len * cp] booleans: query (this rank's token) may see key (a global
        position) where the key's position is not after the query's."""
        queries = self.positions(local_len, device)
        keys = torch.arange(local_len * self.cp, device=device)
        return queries[:, None] >= keys[None, :]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys, fenced to each
        query's document when ``documents`` [batch, whole seq] is given. ``q`` [batch, heads,
        local seq, head_dim] and ``k``, ``v`` [batch, kv heads, local seq, head_dim] are this
        rank's tokens (rotary applied), in the order ``take`` cut them; the result is ``q``'s shape.
        Collective over the cp group when the sequence is split (every cp rank calls it)."""
        if not self.split:
            mask = None if documents is None else document_mask(documents, self)
            return local_attention(q, k, v, mask)
        if self.method is CpMethod.RING:
            from workers.ring_attention import ring_attention

            return ring_attention(q, k, v, self, documents)
        if self.method is CpMethod.ULYSSES:
            from workers.ulysses import ulysses_attention

            return ulysses_attention(q, k, v, self, documents)
        local_len = q.shape[2]
        mask = self.causal_mask(local_len, q.device) if documents is None else document_mask(documents, self)
        k, v = self.gather_sequence(k, dim=2), self.gather_sequence(v, dim=2)
        return local_attention(q, k, v, mask)


def document_mask(documents: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """[batch, 1, local seq, seq] booleans: a query (one of this rank's tokens) sees a key (any
    position of the whole sequence) when the key is not after it and of the same document."""
    local_len = documents.shape[-1] // shard.cp
    queries = shard.positions(local_len, documents.device)
    same_document = documents[:, queries, None] == documents[:, None, :]
    causal = queries[:, None] >= torch.arange(documents.shape[-1], device=documents.device)[None, :]
    return (same_document & causal).unsqueeze(1)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention, or attention under ``mask`` (True: the query sees the key), on this
    rank's tensors alone (no communication); ``k``, ``v`` may have fewer (grouped) heads."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:  # the plain causal kernel (flash on GPU): a run without packing or cp is unchanged
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if gqa and q.device.type != "cpu":
        # Flash takes no mask, and the memory-efficient kernel (which does) no grouped heads: on
        # a GPU the keys and values are repeated per query head rather than fall back to the
        # math kernel, which would hold [batch, heads, seq, seq] scores.
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class _GatherParts(torch.autograd.Function):
    """All-gather over ``group`` stacked [group size, *shape]; the backward is a reduce-scatter,
    written as an all-to-all and the sum of what every rank sent for this rank's part: gloo has
    no reduce-scatter, it moves the same bytes per rank, and one path serves every backend."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grads[0].contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(0), None


WHOLE_SEQUENCE = SequenceShard()
