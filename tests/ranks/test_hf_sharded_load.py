"""Two ranks on real gloo load a sharded Hugging Face directory into DTensors: each reads about
half of the row-sharded bytes and gets exactly its rows, and its columns of column-sharded ones.

    .venv/bin/python -m pytest tests/ranks/test_hf_sharded_load.py -q

Spawned processes (``tests/ranks/hf_ranks.py``); the files and the one-process cases:
tests/unit/test_hf_format.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks.hf_ranks import COLUMN_SHARDED, ROW_SHARDED, run_rank
from tests.ranks.spawned_ranks import spawn_ranks
from tests.unit.test_hf_format import source_tensors, write_sharded


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict[int, tuple[Any, ...]]]:
    folder = tmp_path_factory.mktemp("two-ranks")
    source = source_tensors()
    write_sharded(folder / "hf", source)
    return source, spawn_ranks(run_rank, world_size=2, store_path=str(folder / "store"))


def test_each_rank_reads_about_half_of_row_sharded_parameters(two_ranks):
    source, outcomes = two_ranks
    total = sum(source[hf].numel() * source[hf].element_size() for hf, _ in ROW_SHARDED.values())
    for rank in (0, 1):
        assert not isinstance(outcomes[rank][0], str), outcomes[rank][0]
        read, slices = outcomes[rank][0]["rows"]
        assert read < 0.6 * total
        for fqn, (hf, shape) in ROW_SHARDED.items():
            half = shape[0] // 2
            expected = source[hf].float()[rank * half : (rank + 1) * half]
            assert torch.equal(torch.from_numpy(slices[fqn]), expected)


def test_column_sharded_parameters_get_their_columns(two_ranks):
    source, outcomes = two_ranks
    for rank in (0, 1):
        _, slices = outcomes[rank][0]["columns"]
        for fqn, (hf, shape) in COLUMN_SHARDED.items():
            half = shape[1] // 2
            expected = source[hf].float()[:, rank * half : (rank + 1) * half]
            assert torch.equal(torch.from_numpy(slices[fqn]), expected)
