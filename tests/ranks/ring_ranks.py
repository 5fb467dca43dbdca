"""Ranks (spawned processes, real gloo, no Ray) that check ring attention against attention over
the whole sequence on one process, for tests/unit/test_ring_attention.py.

Four ranks: the world is one cp=4 ring and ranks {0, 1} and {2, 3} two cp=2 rings (sub-groups,
so group peers are not global ranks). Every rank builds the same whole-sequence inputs from a seed,
runs ``SequenceShard.attend`` with ``CpMethod.RING`` on its part, and reports the largest
difference of the output and of dQ, dK, dV from the whole-sequence reference cut to its part.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic.spec import CpMethod
from workers.context_parallel import SequenceShard

WORLD_SIZE = 4
SEQ_LEN = 32  # 8 chunks of 4 at cp=4, 4 chunks of 8 at cp=2


def packed_documents() -> torch.Tensor:
    """[2, SEQ_LEN] document numbers: row 0 has a boundary inside a chunk (5) and a document
    across ranks' chunks (5..18); row 1 one document per half."""
    rows = [[5, 14, 3, 10], [16, 16]]
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in rows])


def whole_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    """The reference: causal (and same-document) attention over the whole sequence."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    positions = torch.arange(q.shape[2])
    mask = (positions[:, None] >= positions[None, :]) & (documents[:, :, None] == documents[:, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=True)


def ring_errors(
    shard: SequenceShard, *, heads: int, kv_heads: int, documents: torch.Tensor | None, seed: int
) -> dict[str, float]:
    """Largest absolute difference of ring attention's output and gradients from the reference."""
    generator = torch.Generator().manual_seed(seed)
    batch, head_dim = 2, 8
    q = torch.randn(batch, heads, SEQ_LEN, head_dim, generator=generator, requires_grad=True)
    k = torch.randn(batch, kv_heads, SEQ_LEN, head_dim, generator=generator, requires_grad=True)
    v = torch.randn(batch, kv_heads, SEQ_LEN, head_dim, generator=generator, requires_grad=True)
    grad_output = torch.randn(batch, heads, SEQ_LEN, head_dim, generator=generator)
    expected = whole_attention(q, k, v, documents)
    expected.backward(grad_output)
    parts = [shard.take(tensor.detach(), dim=2).requires_grad_() for tensor in (q, k, v)]
    output = shard.attend(parts[0], parts[1], parts[2], documents)
    output.backward(shard.take(grad_output, dim=2))
    errors = {"output": (output - shard.take(expected.detach(), dim=2)).abs().max().item()}
    for name, part, whole in zip(("dq", "dk", "dv"), parts, (q, k, v), strict=True):
        assert part.grad is not None and whole.grad is not None
        errors[name] = (part.grad - shard.take(whole.grad, dim=2)).abs().max().item()
    return errors


def run_rank(rank: int, store_path: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD_SIZE), rank=rank, world_size=WORLD_SIZE)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rings = {
        4: SequenceShard(cp=4, cp_rank=rank, group=dist.group.WORLD, method=CpMethod.RING),
        2: SequenceShard(cp=2, cp_rank=rank % 2, group=pairs[rank // 2], method=CpMethod.RING),
    }
    report = {}
    for cp, shard in rings.items():
        for heads, kv_heads in ((4, 2), (2, 2)):
            for packed in (False, True):
                documents = packed_documents() if packed else None
                case = f"cp={cp} heads={heads}/{kv_heads} documents={packed}"
                report[case] = ring_errors(shard, heads=heads, kv_heads=kv_heads, documents=documents, seed=cp + heads)
    results.put((rank, report))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
