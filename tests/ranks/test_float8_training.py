"""``training.float8`` across ranks: pp=2 x dp_shard=2 trains as in float32 within float8's
rounding, and saves the same names, shapes and dtypes (``tests/ranks/float8_ranks.py``; torchao's
emulated casts on the CPU). The layout one rank shows is in tests/unit/test_float8.py."""

from __future__ import annotations

import pytest

from tests.ranks.float8_ranks import run_rank
from tests.ranks.spawned_ranks import spawn_ranks

pytestmark = pytest.mark.slow


def test_float8_across_stages_and_data_parallel_ranks_trains_as_float32_does(tmp_path):
    ranks = spawn_ranks(run_rank, world_size=4, store_path=str(tmp_path / "store"))
    for rank in (2, 3):  # the last stage's ranks report the loss
        losses, _ = ranks[rank]
        assert losses[True] == pytest.approx(losses[False], rel=1e-3) and losses[True] != losses[False]
    for rank in range(4):
        _, states = ranks[rank]
        in_float8, in_float32 = states[True], states[False]
        assert {name: (value.shape, value.dtype) for name, value in in_float8.items()} == {
            name: (value.shape, value.dtype) for name, value in in_float32.items()
        }
