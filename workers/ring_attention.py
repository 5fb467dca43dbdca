"""Ring attention: keys and values pass around the cp ring while each rank attends to the block
it holds (``parallelism.cp_method: ring``).

Runs on every rank of a cp group, called by ``SequenceShard.attend`` (every cp rank calls it, in
the same layer order). Rank ``i`` of ``cp`` holds chunks ``i`` and ``2 * cp - 1 - i`` of ``2 * cp``
(``SequenceShard``); at ring step ``s`` it holds the key/value block of cp rank ``i - s`` (mod cp),
and sends the block it holds to rank ``i + 1`` while it receives the next one from rank ``i - 1``,
the exchange started before the current block's attention so that the transfer hides behind it.
A rank holds at most two blocks of keys and values (the current one and the one arriving), 2 / cp
of the sequence's against the whole sequence under ``allgather``, and keeps only its own for the
backward (``allgather`` keeps the whole sequence's, per layer). The backward adds three float32
blocks of gradients at most (this step's, the ones arriving, the ones leaving).

Forward: per block, attention under the mask of global positions (causal, and same document
when packed), merged with the blocks before by the online softmax (running maximum, sum and
weighted values; the flash-attention merge of each block's output and log-sum-exp). Causality is
decided per chunk pair: a query chunk sees every key of an earlier chunk, the lower triangle of
its own and nothing of a later one, so the pairs a causal mask empties are never computed (with
the load-balanced layout a rank computes two of the four chunk pairs of another rank's block,
three of its own). A pair runs torch's fused flash kernel on CPU (``FUSED_CPU_KERNEL``, fenced in
``checkpointing.torch_compat``); elsewhere the math path: float32 scores in tiles of query rows
(``TILE_SCORE_BYTES``).

Backward (the standard ring-attention backward): the blocks go around the ring again; per block
the probabilities are recomputed from the queries and the saved log-sum-exp, dQ accumulates on
the rank, and dK/dV of the block travel with it (from the rank that visited it to the next) until
they arrive back at the block's owner after a full turn. The partial dK/dV of a step is added to
what arrives only after the step's own compute, so the wait overlaps it too.

Device-agnostic: gloo (CPU) and nccl (CUDA) through ``batch_isend_irecv`` with group peers
(the CUDA path is written, not yet run). Float32 accumulation; the result and the gradients take
the inputs' dtypes. Forward and backward are custom operators, opaque to ``torch.compile``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from checkpointing.torch_compat import cpu_attention_backward, cpu_attention_with_lse, process_group_named
from elastic.spec import CpMethod

if TYPE_CHECKING:
    from workers.context_parallel import SequenceShard

# Keys and values of one cp rank's tokens ([batch, kv heads, local seq, dim] each), or their gradients.
_Block = tuple[torch.Tensor, torch.Tensor]

# The float32 scores one tile of query rows holds against a key chunk (and each of the few
# temporaries of its size): 64 MiB, large enough for full-speed matmuls, small beside a GPU.
TILE_SCORE_BYTES = 64 * 2**20

# On CPU, blocks run torch's fused flash kernel (blocked, no [rows, keys] scores held; about 3x
# the math path's speed); elsewhere, and with this off, the math path below.
FUSED_CPU_KERNEL = True


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, documents: torch.Tensor | None
) -> torch.Tensor:
    """See ``SequenceShard.attend`` for the arguments and the result. Collective over the cp
    group: every cp rank calls it with its own tokens."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention holds two equal chunks per rank; this rank holds {q.shape[2]} tokens")
    output, _ = _ring_attention_op(
        q, k, v, documents, shard.group.group_name, shard.cp, shard.cp_rank, _use_fused_kernel(q)
    )
    return output


@dataclass(frozen=True)
class _ChunkPair:
    """One query chunk (0 or 1 of this rank's two) against one key chunk (0 or 1 of the block's
    two) that the causal mask does not empty; ``diagonal`` when they are the same chunk."""

    query: int
    key: int
    diagonal: bool


def _chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    return cp_rank, 2 * cp - 1 - cp_rank


def _visible_pairs(cp: int, query_rank: int, key_rank: int) -> list[_ChunkPair]:
    """The chunk pairs of ``query_rank``'s queries and ``key_rank``'s keys with a visible part."""
    return [
        _ChunkPair(query=query_index, key=key_index, diagonal=query_chunk == key_chunk)
        for query_index, query_chunk in enumerate(_chunk_ids(cp, query_rank))
        for key_index, key_chunk in enumerate(_chunk_ids(cp, key_rank))
        if query_chunk >= key_chunk
    ]


class _Ring:
    """This rank's neighbours on the cp ring and the one exchange it makes each step: send a
    pair of tensors (keys and values, or their gradients) to the next rank, receive a pair of the
    same shapes from the previous."""

    def __init__(self, shard: SequenceShard) -> None:
        # Chunks are the shard's cp rank's and neighbours are group ranks: they must be the same.
        if dist.get_rank(shard.group) != shard.cp_rank:
            raise ValueError(f"cp rank {shard.cp_rank} is rank {dist.get_rank(shard.group)} of its cp group")
        self.group = shard.group
        self.next_rank = (shard.cp_rank + 1) % shard.cp
        self.previous_rank = (shard.cp_rank - 1) % shard.cp

    def start_exchange(self, outgoing: _Block) -> _Exchange:
        """Start sending ``outgoing`` on and receiving its successor; ``wait`` returns the latter.
        Two tensors in one batch rather than one stacked: no copy of the block to send."""
        outgoing = (outgoing[0].contiguous(), outgoing[1].contiguous())
        incoming = (torch.empty_like(outgoing[0]), torch.empty_like(outgoing[1]))
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, tensor, group=self.group, group_peer=self.next_rank) for tensor in outgoing]
            + [dist.P2POp(dist.irecv, tensor, group=self.group, group_peer=self.previous_rank) for tensor in incoming]
        )
        return _Exchange(outgoing, incoming, works)


class _Exchange:
    """Sends and receives in flight; holds the sent tensors until all are done."""

    def __init__(self, outgoing: _Block, incoming: _Block, works: list[Any]) -> None:
        self._outgoing: _Block | None = outgoing
        self._incoming = incoming
        self._works = works

    def wait(self) -> _Block:
        for work in self._works:
            work.wait()
        self._outgoing = None
        return self._incoming


def _pair_mask(
    diagonal: bool, queries: torch.Tensor, keys: torch.Tensor, documents: torch.Tensor | None
) -> torch.Tensor | None:
    """[batch or 1, 1, 1, queries, keys] booleans (True: the query sees the key) for queries and
    keys at global positions ``queries``, ``keys`` of one chunk pair, or None when every query
    sees every key (an earlier chunk, no documents)."""
    mask = None
    if diagonal:
        mask = (queries[:, None] >= keys[None, :])[None]
    if documents is not None:
        same_document = documents[:, queries, None] == documents[:, None, keys]
        mask = same_document if mask is None else mask & same_document
    return None if mask is None else mask[:, None, None]


def _row_tiles(query: torch.Tensor, key_len: int) -> list[slice]:
    """Query rows in tiles whose float32 scores against ``key_len`` keys stay near
    ``TILE_SCORE_BYTES``: a chunk pair's whole [chunk, chunk] scores would grow with the square of
    the sequence, while a tile's stay bounded (rows are independent under the online softmax)."""
    rows = query.shape[-2]
    per_row = query[..., 0, 0].numel() * key_len * 4  # float32 scores of one row, every head
    size = max(1, min(rows, TILE_SCORE_BYTES // per_row))
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def _scores(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[batch, kv heads, group, rows, keys] float32 scores of the (scaled) ``query`` rows, -inf
    where ``mask`` hides the key."""
    scores = torch.matmul(query, key.unsqueeze(2).transpose(-1, -2))
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores


class _OnlineSoftmax:
    """The running softmax of one query chunk over the key blocks seen so far: the maximum
    score, the sum of exponentials under it and the values weighted by them (float32)."""

    def __init__(self, shape: torch.Size, device: torch.device) -> None:
        """``shape``: the chunk's queries' [batch, kv heads, group, rows, dim]."""
        self.maximum = torch.full(shape[:-1], float("-inf"), dtype=torch.float32, device=device)
        self.total = torch.zeros_like(self.maximum)
        self.weighted = torch.zeros(shape, dtype=torch.float32, device=device)

    def add(self, rows: slice, scores: torch.Tensor, value: torch.Tensor) -> None:
        """Merge ``scores`` [..., rows, keys] of the query ``rows`` against the keys of ``value``
        (consumed: overwritten in place)."""
        previous = self.maximum[..., rows]
        maximum = torch.maximum(previous, scores.amax(dim=-1))
        # A row that has seen no key yet keeps a -inf maximum: shift by 0 so exp gives 0, not NaN.
        shift = torch.where(torch.isinf(maximum), torch.zeros_like(maximum), maximum)
        decay = torch.exp(previous - shift)
        weights = scores.sub_(shift[..., None]).exp_()  # in place: the tile's largest tensor, once
        weighted = self.weighted[..., rows, :] * decay[..., None] + torch.matmul(weights, value.unsqueeze(2))
        self.weighted[..., rows, :] = weighted
        self.total[..., rows] = self.total[..., rows] * decay + weights.sum(dim=-1)
        self.maximum[..., rows] = maximum

    def add_block(self, output: torch.Tensor, log_sum_exp: torch.Tensor) -> None:
        """Merge a block's own attention ``output`` and ``log_sum_exp`` over every row (a block
        is the state of one key: maximum ``log_sum_exp``, total 1, weighted ``output``)."""
        maximum = torch.maximum(self.maximum, log_sum_exp)
        shift = torch.where(torch.isinf(maximum), torch.zeros_like(maximum), maximum)
        decay, weight = torch.exp(self.maximum - shift), torch.exp(log_sum_exp - shift)
        self.weighted = self.weighted * decay[..., None] + output * weight[..., None]
        self.total = self.total * decay + weight
        self.maximum = maximum

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output and the log-sum-exp (-inf, and output 0, for a row with no key)."""
        seen = self.total > 0
        total = torch.where(seen, self.total, torch.ones_like(self.total))
        output = torch.where(seen[..., None], self.weighted / total[..., None], torch.zeros_like(self.weighted))
        log_sum_exp = torch.where(seen, self.maximum + torch.log(total), torch.full_like(total, float("-inf")))
        return output, log_sum_exp


def _grouped(tensor: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[batch, heads, seq, dim] as float32 [batch, kv heads, heads per kv head, seq, dim]."""
    batch, heads, seq, dim = tensor.shape
    return tensor.float().reshape(batch, kv_heads, heads // kv_heads, seq, dim)


def _use_fused_kernel(q: torch.Tensor) -> bool:
    """Whether blocks run the fused CPU kernel (``FUSED_CPU_KERNEL``) rather than the math path."""
    return FUSED_CPU_KERNEL and q.device.type == "cpu"


def _repeated(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, kv heads, seq, dim] with each kv head repeated for its query heads (the fused
    kernel takes equal heads)."""
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def _fused_mask(diagonal: bool, mask: torch.Tensor | None, dtype: torch.dtype) -> tuple[bool, torch.Tensor | None]:
    """The fused kernel's causal flag and additive [batch, 1, queries, keys] mask for a pair."""
    if mask is None:
        return diagonal, None
    hidden = ~mask.squeeze(2)
    return False, torch.zeros(hidden.shape, dtype=dtype, device=mask.device).masked_fill_(hidden, float("-inf"))


def _fused_block(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, diagonal: bool, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk pair on the fused CPU kernel: the float32 output [batch, kv heads, group, rows,
    dim] and log-sum-exp [batch, kv heads, group, rows] of ``query`` over ``key``, ``value``
    (their kv heads repeated here, one key chunk at a time, not the whole block)."""
    kv_heads, heads = key.shape[1], query.shape[1]
    is_causal, additive = _fused_mask(diagonal, mask, query.dtype)
    output, log_sum_exp = cpu_attention_with_lse(
        query, _repeated(key, heads), _repeated(value, heads), is_causal=is_causal, mask=additive, scale=scale
    )
    if mask is not None:  # rows that see no key of this pair: lse -inf, not the kernel's 0
        log_sum_exp = log_sum_exp.masked_fill(~mask.any(dim=-1).squeeze(2), float("-inf"))
    return _grouped(output, kv_heads), _grouped(log_sum_exp.unsqueeze(-1), kv_heads).squeeze(-1)


class _MathBackward:
    """A rank's part of the backward on the math path, in tiles of query rows: dQ accumulates
    here, ``visit`` returns a block's dK, dV (float32, per key chunk)."""

    def __init__(
        self, scale: float, q: torch.Tensor, kv_heads: int, output: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor
    ) -> None:
        self.scale, self.kv_heads = scale, kv_heads
        # Scaled as in the forward; dQ takes the scale at the end, dK has it from the queries.
        self.queries = (_grouped(q, kv_heads) * scale).chunk(2, dim=3)
        self.grad_outputs = _grouped(grad, kv_heads).chunk(2, dim=3)
        # Per query row: sum of dO * O, the softmax backward's correction term.
        self.corrections = (_grouped(grad, kv_heads) * _grouped(output, kv_heads)).sum(dim=-1).chunk(2, dim=3)
        # A row that saw no key has lse -inf and all scores -inf: shift by 0 so its weights are 0.
        safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        self.safe_lse = _grouped(safe_lse.unsqueeze(-1), kv_heads).squeeze(-1).chunk(2, dim=3)
        self.grad_queries = [torch.zeros_like(query) for query in self.queries]

    def visit(
        self, block: _Block, pairs: list[tuple[_ChunkPair, torch.Tensor | None]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        keys, values = block[0].float().chunk(2, dim=2), block[1].float().chunk(2, dim=2)
        grad_keys = [torch.zeros_like(key) for key in keys]
        grad_values = [torch.zeros_like(value) for value in values]
        for pair, pair_mask in pairs:
            key, value = keys[pair.key], values[pair.key]
            for rows in _row_tiles(self.queries[pair.query], key.shape[2]):
                query = self.queries[pair.query][..., rows, :]
                mask = None if pair_mask is None else pair_mask[..., rows, :]
                weights = _scores(query, key, mask).sub_(self.safe_lse[pair.query][..., rows, None]).exp_()
                grad_output = self.grad_outputs[pair.query][..., rows, :]
                grad_values[pair.key] += torch.matmul(weights.transpose(-1, -2), grad_output).sum(dim=2)
                grad_weights = torch.matmul(grad_output, value.unsqueeze(2).transpose(-1, -2))
                grad_scores = grad_weights.sub_(self.corrections[pair.query][..., rows, None]).mul_(weights)
                self.grad_queries[pair.query][..., rows, :] += torch.matmul(grad_scores, key.unsqueeze(2))
                grad_keys[pair.key] += torch.matmul(grad_scores.transpose(-1, -2), query).sum(dim=2)
        return grad_keys, grad_values

    def grad_q(self) -> torch.Tensor:
        grad = torch.cat(self.grad_queries, dim=3) * self.scale
        return grad.reshape(grad.shape[0], -1, *grad.shape[3:])


class _FusedBackward:
    """A rank's part of the backward on the fused CPU kernel: per chunk pair the kernel's own
    backward, given the rows' output and log-sum-exp over the whole sequence."""

    def __init__(
        self, scale: float, q: torch.Tensor, output: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor
    ) -> None:
        self.scale, self.heads = scale, q.shape[1]
        self.queries, self.outputs = q.chunk(2, dim=2), output.chunk(2, dim=2)
        self.grad_outputs, self.lse = grad.contiguous().chunk(2, dim=2), lse.chunk(2, dim=2)
        self.grad_queries = [torch.zeros_like(query, dtype=torch.float32) for query in self.queries]

    def visit(
        self, block: _Block, pairs: list[tuple[_ChunkPair, torch.Tensor | None]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        kv_shape = block[0].chunk(2, dim=2)[0].shape
        keys, values = block[0].chunk(2, dim=2), block[1].chunk(2, dim=2)
        grad_keys = [torch.zeros(kv_shape, dtype=torch.float32, device=block[0].device) for _ in range(2)]
        grad_values = [torch.zeros_like(grad_key) for grad_key in grad_keys]
        for pair, mask in pairs:
            is_causal, additive = _fused_mask(pair.diagonal, mask, block[0].dtype)
            grad_q, grad_k, grad_v = cpu_attention_backward(
                self.grad_outputs[pair.query],
                self.queries[pair.query],
                _repeated(keys[pair.key], self.heads),  # one key chunk at a time, not the whole block
                _repeated(values[pair.key], self.heads),
                self.outputs[pair.query],
                self.lse[pair.query],
                is_causal=is_causal,
                mask=additive,
                scale=self.scale,
            )
            self.grad_queries[pair.query] += grad_q.float()
            # The repeated heads' gradients sum into their kv head.
            grad_keys[pair.key] += grad_k.float().unflatten(1, (kv_shape[1], -1)).sum(dim=2)
            grad_values[pair.key] += grad_v.float().unflatten(1, (kv_shape[1], -1)).sum(dim=2)
        return grad_keys, grad_values

    def grad_q(self) -> torch.Tensor:
        return torch.cat(self.grad_queries, dim=2)


def _positions(shard: SequenceShard, cp_rank: int, chunk: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.arange(index * chunk, (index + 1) * chunk, device=device) for index in _chunk_ids(shard.cp, cp_rank)]


class _MathForward:
    """A rank's part of the forward on the math path, in tiles of query rows: scores in float32,
    merged into each query chunk's online softmax."""

    def __init__(self, q: torch.Tensor, kv_heads: int, scale: float) -> None:
        # Scaled once: every block's scores are then a plain product.
        self.queries = (_grouped(q, kv_heads) * scale).chunk(2, dim=3)
        self.softmaxes = [_OnlineSoftmax(query.shape, q.device) for query in self.queries]

    def visit(self, block: _Block, pairs: list[tuple[_ChunkPair, torch.Tensor | None]]) -> None:
        keys, values = block[0].float().chunk(2, dim=2), block[1].float().chunk(2, dim=2)
        for pair, pair_mask in pairs:
            for rows in _row_tiles(self.queries[pair.query], keys[pair.key].shape[2]):
                mask = None if pair_mask is None else pair_mask[..., rows, :]
                scores = _scores(self.queries[pair.query][..., rows, :], keys[pair.key], mask)
                self.softmaxes[pair.query].add(rows, scores, values[pair.key])


class _FusedForward:
    """A rank's part of the forward on the fused CPU kernel: each chunk pair's output and
    log-sum-exp merged into each query chunk's online softmax."""

    def __init__(self, q: torch.Tensor, kv_heads: int, scale: float) -> None:
        self.queries, self.scale = q.chunk(2, dim=2), scale
        batch, heads, chunk, dim = self.queries[0].shape
        shape = torch.Size((batch, kv_heads, heads // kv_heads, chunk, dim))
        self.softmaxes = [_OnlineSoftmax(shape, q.device) for _ in range(2)]

    def visit(self, block: _Block, pairs: list[tuple[_ChunkPair, torch.Tensor | None]]) -> None:
        keys, values = block[0].chunk(2, dim=2), block[1].chunk(2, dim=2)
        for pair, mask in pairs:
            query, key, value = self.queries[pair.query], keys[pair.key], values[pair.key]
            self.softmaxes[pair.query].add_block(*_fused_block(query, key, value, pair.diagonal, mask, self.scale))


def _pairs_with_masks(
    shard: SequenceShard, source: int, chunk: int, documents: torch.Tensor | None, device: torch.device
) -> list[tuple[_ChunkPair, torch.Tensor | None]]:
    """The chunk pairs of this rank's queries and cp rank ``source``'s keys to compute, each
    with its mask (``_pair_mask``)."""
    query_positions = _positions(shard, shard.cp_rank, chunk, device)
    key_positions = _positions(shard, source, chunk, device)
    return [
        (pair, _pair_mask(pair.diagonal, query_positions[pair.query], key_positions[pair.key], documents))
        for pair in _visible_pairs(shard.cp, shard.cp_rank, source)
    ]


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: SequenceShard, documents: torch.Tensor | None, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward around the ring: the output (``q``'s dtype) and its float32 log-sum-exp
    [batch, heads, local seq]."""
    kv_heads, chunk = k.shape[1], q.shape[2] // 2
    scale = 1.0 / math.sqrt(q.shape[-1])
    kernel = _FusedForward(q, kv_heads, scale) if fused else _MathForward(q, kv_heads, scale)
    ring = _Ring(shard)
    block: _Block = (k, v)
    for step in range(shard.cp):
        exchange = ring.start_exchange(block) if step < shard.cp - 1 else None
        source = (shard.cp_rank - step) % shard.cp
        kernel.visit(block, _pairs_with_masks(shard, source, chunk, documents, q.device))
        if exchange is not None:
            block = exchange.wait()
    outputs, log_sum_exps = zip(*(softmax.result() for softmax in kernel.softmaxes), strict=True)
    output = torch.cat(outputs, dim=3).reshape(q.shape).to(q.dtype)
    return output, torch.cat(log_sum_exps, dim=3).reshape(q.shape[:-1])


def _ring_backward(
    grad_output: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    shard: SequenceShard,
    documents: torch.Tensor | None,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward around the ring, from ``saved`` q, k, v, output and log-sum-exp: dQ, dK, dV."""
    q, k, v, output, log_sum_exp = saved
    kv_heads, chunk = k.shape[1], q.shape[2] // 2
    scale = 1.0 / math.sqrt(q.shape[-1])
    kernel = (
        _FusedBackward(scale, q, output, grad_output, log_sum_exp)
        if fused
        else _MathBackward(scale, q, kv_heads, output, grad_output, log_sum_exp)
    )
    ring = _Ring(shard)
    block: _Block = (k, v)
    block_grads: _Exchange | None = None  # dK/dV of the block this rank visits next, on their way
    for step in range(shard.cp):
        exchange = ring.start_exchange(block) if step < shard.cp - 1 else None
        source = (shard.cp_rank - step) % shard.cp
        grad_keys, grad_values = kernel.visit(block, _pairs_with_masks(shard, source, chunk, documents, q.device))
        local_grads = (torch.cat(grad_keys, dim=2), torch.cat(grad_values, dim=2))
        if block_grads is not None:
            arrived = block_grads.wait()
            local_grads[0].add_(arrived[0])
            local_grads[1].add_(arrived[1])
        # On to the next rank, which visits this block next step (its owner after the last).
        block_grads = ring.start_exchange(local_grads)
        if exchange is not None:
            block = exchange.wait()
    assert block_grads is not None
    own_grads = block_grads.wait()
    return kernel.grad_q().to(q.dtype), own_grads[0].to(k.dtype), own_grads[1].to(v.dtype)


# Custom operators rather than an autograd.Function: opaque to torch.compile (a compiled block,
# ``training.compile``, traces its whole forward, and dynamo cannot trace point-to-point sends),
# so they take the cp group by name and its ranks as numbers.
def _ring_shard(group_name: str, cp: int, cp_rank: int) -> SequenceShard:
    from workers.context_parallel import SequenceShard

    return SequenceShard(cp=cp, cp_rank=cp_rank, group=process_group_named(group_name), method=CpMethod.RING)


@torch.library.custom_op("meshpilot::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    group_name: str,
    cp: int,
    cp_rank: int,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    output, log_sum_exp = _ring_forward(q, k, v, _ring_shard(group_name, cp, cp_rank), documents, fused)
    return output.contiguous(), log_sum_exp.contiguous()


@_ring_attention_op.register_fake
def _ring_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None,
    group_name: str,
    cp: int,
    cp_rank: int,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Contiguous like the real results, whatever the strides of the inputs (q is often a transpose).
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("meshpilot::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    grad_output: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    log_sum_exp: torch.Tensor,
    documents: torch.Tensor | None,
    group_name: str,
    cp: int,
    cp_rank: int,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    saved = (q, k, v, output, log_sum_exp)
    grads = _ring_backward(grad_output, saved, _ring_shard(group_name, cp, cp_rank), documents, fused)
    return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous()


@_ring_attention_backward_op.register_fake
def _ring_attention_backward_fake(
    grad_output: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    output: torch.Tensor,
    log_sum_exp: torch.Tensor,
    documents: torch.Tensor | None,
    group_name: str,
    cp: int,
    cp_rank: int,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, documents, *ring = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.documents, ctx.ring = documents, ring


def _backward(ctx: Any, grad_output: torch.Tensor, _grad_log_sum_exp: torch.Tensor | None) -> tuple[Any, ...]:
    grads = _ring_attention_backward_op(grad_output.contiguous(), *ctx.saved_tensors, ctx.documents, *ctx.ring)
    return (*grads, None, None, None, None, None)


_ring_attention_op.register_autograd(_backward, setup_context=_save_for_backward)
