"""Ranks (spawned processes, real gloo, no Ray) that check ring attention against attention over
the whole sequence on one process, for tests/unit/test_ring_attention.py.

Four ranks: the world is one cp=4 ring and ranks {0, 1} and {2, 3} two cp=2 rings (sub-groups,
so group peers are not global ranks). Every rank builds the same whole-sequence inputs from a seed,
runs ``SequenceShard.attend`` with ``CpMethod.RING`` on its part, and reports the largest
difference of the output and of dQ, dK, dV from the whole-sequence reference cut to its part.
"""

from __future__ import annotations

import os
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from elastic.spec import CpMethod
from workers import ring_attention
from workers.context_parallel import SequenceShard

WORLD_SIZE = 4
SEQ_LEN = 32  # 8 chunks of 4 at cp=4, 4 chunks of 8 at cp=2
DEFAULT_TILE_SCORE_BYTES = ring_attention.TILE_SCORE_BYTES


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
    shard: SequenceShard,
    *,
    heads: int,
    kv_heads: int,
    documents: torch.Tensor | None,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """Largest absolute difference of ring attention's output and gradients (of inputs in
    ``dtype``) from the float32 reference, relative to the reference's largest value when
    ``dtype`` is not float32."""
    generator = torch.Generator().manual_seed(seed)
    batch, head_dim = 2, 8
    q = torch.randn(batch, heads, SEQ_LEN, head_dim, generator=generator, requires_grad=True)
    k = torch.randn(batch, kv_heads, SEQ_LEN, head_dim, generator=generator, requires_grad=True)
    v = torch.randn(batch, kv_heads, SEQ_LEN, head_dim, generator=generator, requires_grad=True)
    grad_output = torch.randn(batch, heads, SEQ_LEN, head_dim, generator=generator)
    expected = whole_attention(q, k, v, documents)
    expected.backward(grad_output)
    parts = [shard.take(tensor.detach(), dim=2).to(dtype).requires_grad_() for tensor in (q, k, v)]
    output = shard.attend(parts[0], parts[1], parts[2], documents)
    output.backward(shard.take(grad_output, dim=2).to(dtype))
    results = [(output.detach(), expected.detach())]
    for part, whole in zip(parts, (q, k, v), strict=True):
        assert part.grad is not None and whole.grad is not None
        results.append((part.grad, whole.grad))
    errors = {}
    for name, (result, reference) in zip(("output", "dq", "dk", "dv"), results, strict=True):
        # A result in another dtype than its input's counts as wrong whatever its values.
        error = (result.float() - shard.take(reference, dim=2)).abs().max() if result.dtype == dtype else torch.inf
        errors[name] = float(error if dtype == torch.float32 else error / reference.abs().max())
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
    for fused in (True, False):  # torch's fused CPU kernel per block, and the math path (CUDA's)
        ring_attention.FUSED_CPU_KERNEL = fused
        for cp, shard in rings.items():
            for heads, kv_heads in ((4, 2), (2, 2)):
                for packed in (False, True):
                    documents = packed_documents() if packed else None
                    # Packed cases in tiles of 3 query rows (the last one shorter), the others whole chunks.
                    row_bytes = 2 * heads * SEQ_LEN // (2 * cp) * 4
                    ring_attention.TILE_SCORE_BYTES = 3 * row_bytes if packed else DEFAULT_TILE_SCORE_BYTES
                    case = f"fused={fused} cp={cp} heads={heads}/{kv_heads} documents={packed}"
                    report[case] = ring_errors(
                        shard, heads=heads, kv_heads=kv_heads, documents=documents, seed=cp + heads
                    )
        for cp, shard in rings.items():  # bfloat16 in, bfloat16 out, float32 inside
            report[f"fused={fused} cp={cp} bfloat16"] = ring_errors(
                shard, heads=4, kv_heads=2, documents=packed_documents(), seed=cp, dtype=torch.bfloat16
            )
    results.put((rank, report))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


def attention_cost(shard: SequenceShard, *, seq_len: int, heads: int, kv_heads: int, head_dim: int, repeats: int):
    """In a cp rank, collective over ``shard``'s group: the median and the least seconds of one
    forward and backward of ``shard.attend`` on random float32 [1, heads, seq_len / cp, head_dim] queries
    (and [1, kv_heads, ...] keys and values), and the rise of the process's peak resident memory
    over the first of them (bytes)."""
    import resource
    import statistics
    import time

    local_len = seq_len // shard.cp
    q = torch.randn(1, heads, local_len, head_dim, requires_grad=True)
    k = torch.randn(1, kv_heads, local_len, head_dim, requires_grad=True)
    v = torch.randn(1, kv_heads, local_len, head_dim, requires_grad=True)
    grad_output = torch.randn_like(q)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = []
    for _ in range(repeats + 1):
        dist.barrier(group=shard.group)
        start = time.perf_counter()
        shard.attend(q, k, v).backward(grad_output)
        seconds.append(time.perf_counter() - start)
    peak_rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # ru_maxrss is KiB on Linux
    return statistics.median(seconds[1:]), min(seconds[1:]), peak_rise


def measure_rank(
    rank: int, store_path: str, results, *, cp: int, method: CpMethod, seq_len: int, fused: bool = True
) -> None:
    """A cp rank of the measurement below: the debug preset's heads (4 query, 2 key/value, 16 wide)."""
    torch.set_num_threads(1)
    ring_attention.FUSED_CPU_KERNEL = fused
    dist.init_process_group("gloo", store=dist.FileStore(store_path, cp), rank=rank, world_size=cp)
    shard = SequenceShard(cp=cp, cp_rank=rank, group=dist.group.WORLD, method=method)
    median, least, peak_rise = attention_cost(shard, seq_len=seq_len, heads=4, kv_heads=2, head_dim=16, repeats=5)
    results.put((rank, median, least, peak_rise))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    # Ring against all-gather attention, forward and backward, one thread per rank:
    #   PYTHONPATH=. python tests/ranks/ring_ranks.py 4096
    import functools
    import sys
    import tempfile

    from tests.ranks.spawned_ranks import spawn_ranks

    seq_len = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    for cp in (2, 4):
        for method, fused in ((CpMethod.ALLGATHER, True), (CpMethod.RING, True), (CpMethod.RING, False)):
            with tempfile.TemporaryDirectory() as scratch:
                ranks = spawn_ranks(
                    functools.partial(measure_rank, cp=cp, method=method, seq_len=seq_len, fused=fused),
                    world_size=cp,
                    store_path=f"{scratch}/store",
                )
            median = max(median for median, _, _ in ranks.values()) * 1e3  # the slowest rank's
            least = max(least for _, least, _ in ranks.values()) * 1e3
            rise = max(peak_rise for _, _, peak_rise in ranks.values()) / 2**20
            name = method.value if method is CpMethod.ALLGATHER else f"ring ({'fused' if fused else 'math'})"
            times = f"median {median:7.1f} ms, best {least:7.1f} ms"
            print(f"seq={seq_len} cp={cp} {name:12s} fwd+bwd {times}, peak rss +{rise:.1f} MiB")


def run_compiled_rank(rank: int, store_path: str, results, *, backend: str = "inductor") -> None:
    """A cp=2 rank: ring attention inside ``torch.compile(fullgraph=True)`` (as a compiled block
    holds it; inductor, not aot_eager, checks the custom operators' results against their fake
    shapes and strides) against eager, packed; reports the largest difference of output and
    gradients, or the error."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    shard = SequenceShard(cp=2, cp_rank=rank, group=dist.group.WORLD, method=CpMethod.RING)
    documents = packed_documents()
    generator = torch.Generator().manual_seed(rank)
    # [batch, heads, seq, dim] views of [batch, seq, heads, dim], as a model's projections give them.
    inputs = [torch.randn(2, SEQ_LEN // 2, heads, 8, generator=generator).transpose(1, 2) for heads in (4, 2, 2)]

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return shard.attend(q, k, v, documents).sin()

    runs = []
    try:
        for function in (block, torch.compile(block, fullgraph=True, backend=backend)):
            parts = [tensor.clone().requires_grad_() for tensor in inputs]  # clone keeps the strides
            output = function(*parts)
            output.sum().backward()
            runs.append([output.detach(), *(cast(torch.Tensor, part.grad) for part in parts)])
        outcome: float | str = max(float((eager - compiled).abs().max()) for eager, compiled in zip(*runs, strict=True))
    except Exception as error:  # noqa: BLE001 - the test names it rather than waiting out its timeout
        outcome = f"{type(error).__name__}: {error}"[:2000]
    results.put((rank, outcome))
    results.close()
    results.join_thread()
    dist.barrier()
    os._exit(0)
