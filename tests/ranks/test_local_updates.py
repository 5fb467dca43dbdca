"""The step's norm, clip and AdamW on local shards (``workers/local_updates.py``) give what
torch's own give on the DTensors: the norm of the whole gradients, the clip bit for bit, and
AdamW's parameters and state bit for bit, state kept as DTensors in torch's layout.

Two spawned processes on real gloo (``tests/ranks/local_update_ranks.py``), a 2-rank mesh.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.ranks.local_update_ranks import run_rank
from tests.ranks.spawned_ranks import spawn_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, tuple[Any, ...]]:
    return spawn_ranks(run_rank, world_size=2, store_path=str(tmp_path_factory.mktemp("store") / "store"))


def assert_bitwise_equal(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for index, (left, right) in enumerate(zip(ours, theirs, strict=True)):
        assert left.shape == right.shape and left.dtype == right.dtype, index
        assert np.array_equal(left, right), f"tensor {index} differs"


def test_the_norm_is_that_of_the_whole_gradients_on_every_rank(ranks):
    for rank in (0, 1):
        norm, expected, with_pending_sum = ranks[rank][:3]
        assert norm == pytest.approx(expected, rel=1e-6)
        assert with_pending_sum == pytest.approx(expected, rel=1e-6)
    assert ranks[0][0] == ranks[1][0]


def test_the_clip_scales_each_shard_as_torchs_clip_does(ranks):
    for rank in (0, 1):
        clipped, torch_clipped, unclipped = ranks[rank][3:6]
        assert_bitwise_equal(clipped, torch_clipped)
        # The norm is above MAX_NORM: every gradient was scaled down, none left as it was.
        assert all(abs(after).sum() < abs(before).sum() for after, before in zip(clipped, unclipped, strict=True))


def test_adamw_on_local_shards_leaves_torchs_parameters_and_state(ranks):
    for rank in (0, 1):
        params, torch_params, states, torch_states = ranks[rank][6:10]
        assert_bitwise_equal(params, torch_params)
        for state, torch_state in zip(states, torch_states, strict=True):
            assert state.keys() == torch_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key in state:
                assert state[key][:2] == torch_state[key][:2], key  # type and dtype
                assert_bitwise_equal([state[key][2]], [torch_state[key][2]])
    # The split parameters' moments stay DTensors (checkpoints read their placements).
    assert ranks[0][8][0]["exp_avg"][0] == "DTensor"
