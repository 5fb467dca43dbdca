"""A fresh run's initial parameter values: the same model on every mesh, each rank drawing only its slice.

Runs on every rank at a fresh start (``Trainer.init_weights``), collective-free. A parameter's
random values are drawn in fixed tiles of the full tensor, each tile from its own generator
seeded by (run seed, parameter name, tile number). A rank draws only the tiles its slice
overlaps, so a tp=8 column slice of a 4096 x 4096 weight draws 4096 x 1024 values instead of the
whole matrix (a 70B model's full parameters on one CPU thread took minutes), and every layout of
the same model gets bit-identical values: the loss-parity and reshape tests rely on that.

A parameter that fits in one tile is drawn with the seed single-tile draws have always had
(``seed * 1_000_003 + crc32(name)``), so models up to 1024 wide start exactly as before tiles.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from checkpointing.torch_compat import local_shape_and_offset
from workers.models.family import InitRule, ModelFamily, StageModel
from workers.spec import ModelSpec
from workers.spec.lora import is_adapter

# A tile holds at most 2 ** INIT_TILE_BITS values: 1024 x 1024 for a matrix (4 MB of float32),
# the whole vector for a norm weight.
INIT_TILE_BITS = 20


@torch.no_grad()
def init_weights(
    module: StageModel, family: ModelFamily, model: ModelSpec, *, seed: int, adapters_only: bool = False
) -> None:
    """Initialise this rank's slice of every parameter as a single-process run with ``seed`` would
    (``adapters_only``: only the LoRA adapters, beside a base loaded from released weights).

    Runs on every rank of a fresh run, after ``materialize``; no collective.
    """
    for fqn, param in module.named_parameters():
        if adapters_only and not is_adapter(fqn):
            continue
        local = param.to_local() if isinstance(param, DTensor) else param.data
        rule = adapter_init_rule(fqn, tuple(param.shape)) if is_adapter(fqn) else family.init_rule(fqn, model)
        if rule.std is None and rule.bound is None:
            local.fill_(rule.value)
            continue
        offset = local_shape_and_offset(param)[1] if isinstance(param, DTensor) else (0,) * param.dim()
        draw_slice(local, fqn, full_shape=tuple(param.shape), offset=tuple(offset), rule=rule, seed=seed)


def adapter_init_rule(fqn: str, shape: tuple[int, ...]) -> InitRule:
    """PEFT's LoRA initialisation: B at zero (training starts from the base model exactly), A as
    ``kaiming_uniform_(a=sqrt(5))`` draws it, uniform in +-1/sqrt(in_features)."""
    if fqn.endswith(".lora_B.weight"):
        return InitRule.fill(0.0)
    return InitRule.uniform(1.0 / math.sqrt(shape[1]))


def draw_normal_slice(
    out: torch.Tensor, fqn: str, *, full_shape: Sequence[int], offset: Sequence[int], std: float, seed: int
) -> int:
    """``draw_slice`` with a normal distribution of ``std``."""
    return draw_slice(out, fqn, full_shape=full_shape, offset=offset, rule=InitRule.normal(std), seed=seed)


def draw_slice(
    out: torch.Tensor, fqn: str, *, full_shape: Sequence[int], offset: Sequence[int], rule: InitRule, seed: int
) -> int:
    """Fill ``out``, the box of parameter ``fqn`` starting at ``offset``, with its initial values
    (``rule``: normal with its ``std``, or uniform within its ``bound``).

    Only the tiles overlapping the box are drawn, one at a time: at most the box plus one tile
    edge on each side along each dim, whichever dims the mesh shards. Returns how many values
    it drew (tests count them).
    """
    if out.numel() == 0:
        return 0
    edge, grid = tile_edge(len(full_shape)), tile_grid(full_shape)
    spans = [range(start // edge, -(-(start + length) // edge)) for start, length in zip(offset, out.shape)]
    drawn = 0
    for tile in itertools.product(*spans):
        tile_start = [index * edge for index in tile]
        tile_shape = [min(edge, size - start) for start, size in zip(tile_start, full_shape)]
        generator = torch.Generator().manual_seed(tile_seed(seed, fqn, tile, grid))
        values = torch.empty(tile_shape, dtype=torch.float32)
        if rule.bound is not None:
            values.uniform_(-rule.bound, rule.bound, generator=generator)
        else:
            values.normal_(0.0, rule.std or 0.0, generator=generator)
        drawn += values.numel()
        _copy_overlap(out, offset, values, tile_start)
    return drawn


def tile_edge(ndim: int) -> int:
    """Edge length, along every dim, of the tiles of an ``ndim``-dim parameter."""
    return 1 << (INIT_TILE_BITS // max(ndim, 1))


def tile_grid(shape: Sequence[int]) -> tuple[int, ...]:
    """How many tiles a parameter of ``shape`` has along each dim (the last ones may be partial)."""
    edge = tile_edge(len(shape))
    return tuple(max(1, -(-size // edge)) for size in shape)


def tile_seed(seed: int, fqn: str, tile: Sequence[int], grid: Sequence[int]) -> int:
    """The generator seed of one tile; a one-tile parameter keeps the seed of a whole-tensor draw."""
    if all(count == 1 for count in grid):
        return seed * 1_000_003 + zlib.crc32(fqn.encode())
    number = 0
    for position, count in zip(tile, grid):
        number = number * count + position
    return seed * 1_000_003 + zlib.crc32(f"{fqn}#{number}".encode())


def _copy_overlap(out: torch.Tensor, offset: Sequence[int], tile: torch.Tensor, tile_start: Sequence[int]) -> None:
    """Copy the part of ``tile`` (at ``tile_start`` in the full parameter) that ``out`` (at ``offset``) covers."""
    low = [max(a, b) for a, b in zip(tile_start, offset)]
    high = [min(a + n, b + m) for a, n, b, m in zip(tile_start, tile.shape, offset, out.shape)]
    into = tuple(slice(lo - at, hi - at) for lo, hi, at in zip(low, high, offset))
    source = tuple(slice(lo - at, hi - at) for lo, hi, at in zip(low, high, tile_start))
    out[into].copy_(tile[source])
