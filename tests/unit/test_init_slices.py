"""Initialisation is the same model whatever the mesh, and a rank draws only its own slice.

Pure slices of one parameter (any offsets, no process group), put back together, are the one
process's parameter. The debug model on two spawned gloo ranks: tests/ranks/test_init_on_two_ranks.py.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from tests.ranks.init_ranks import TILE_BITS
from workers import initial_values
from workers.initial_values import draw_normal_slice, tile_edge

FQN = "layers.0.mlp.gate_proj.weight"
SHAPE = (100, 70)  # not a multiple of the 16 x 16 tiles, so slices cut through tiles
STD = 0.02


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(initial_values, "INIT_TILE_BITS", TILE_BITS)


def chunks(size: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of torch's chunking of ``size`` into ``parts``, as DTensor's Shard does."""
    step = -(-size // parts)
    return [(start, max(0, min(step, size - start))) for start in range(0, parts * step, step)]


def layout(rows: int, cols: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(offset, shape) of every rank's slice when rows go to ``rows`` ranks and columns to ``cols``."""
    return [
        ((row_start, col_start), (row_length, col_length))
        for row_start, row_length in chunks(SHAPE[0], rows)
        for col_start, col_length in chunks(SHAPE[1], cols)
    ]


def draw(offset: tuple[int, ...], shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, int]:
    out = torch.empty(shape)
    drawn = draw_normal_slice(out, FQN, full_shape=SHAPE, offset=offset, std=STD, seed=seed)
    return out, drawn


@pytest.mark.parametrize(
    "rows, cols",
    [(2, 1), (1, 2), (2, 2), (3, 1), (8, 1), (1, 8)],
    ids=["dp_shard2", "tp2-columns", "dp_shard2-tp2", "dp_shard3-uneven", "dp_shard8", "tp8-columns"],
)
def test_slices_of_any_layout_put_together_are_the_one_process_parameter(small_tiles, rows, cols):
    whole, _ = draw((0, 0), SHAPE)
    assembled = torch.full(SHAPE, float("nan"))
    for (row, col), (n_rows, n_cols) in layout(rows, cols):
        part, _ = draw((row, col), (n_rows, n_cols))
        assembled[row : row + n_rows, col : col + n_cols] = part
    assert torch.equal(assembled, whole)


@pytest.mark.parametrize("rows, cols", [(8, 1), (1, 8), (4, 2)], ids=["dp_shard8", "tp8-columns", "dp_shard4-tp2"])
def test_a_rank_draws_its_slice_plus_at_most_one_tile_edge_per_side(small_tiles, rows, cols):
    edge = tile_edge(2)
    for offset, shape in layout(rows, cols):
        _, drawn = draw(offset, shape)
        assert drawn <= math.prod(min(length + 2 * (edge - 1), full) for length, full in zip(shape, SHAPE))
        assert drawn < math.prod(SHAPE)


def test_a_large_column_slice_draws_no_full_rows():
    """Default tiles (1024 x 1024): a tp=8 column slice of a 4096 x 4096 weight draws a quarter of it."""
    out = torch.empty((4096, 512))
    drawn = draw_normal_slice(out, FQN, full_shape=(4096, 4096), offset=(0, 1536), std=STD, seed=0)
    assert drawn == 4096 * 1024
    assert out.std().item() == pytest.approx(STD, rel=0.01)


def test_tiles_are_drawn_independently_and_seeds_matter(small_tiles):
    whole, _ = draw((0, 0), SHAPE)
    other_seed, _ = draw((0, 0), SHAPE, seed=1)
    assert not torch.equal(whole, other_seed)
    tiles = whole[:96, :64].reshape(6, 16, 4, 16).transpose(1, 2).reshape(24, 256)
    assert len({tuple(tile.tolist()) for tile in tiles}) == 24  # no two tiles repeat


def test_a_parameter_in_one_tile_starts_as_a_whole_tensor_draw_always_did():
    """Models up to 1024 wide keep their initial values (and every figure measured on them)."""
    out, _ = draw((0, 0), SHAPE, seed=3)
    generator = torch.Generator().manual_seed(3 * 1_000_003 + zlib.crc32(FQN.encode()))
    assert torch.equal(out, torch.empty(SHAPE).normal_(0.0, STD, generator=generator))
