"""Loss-parallel logits: with tp > 1 each rank holds only its vocabulary shard of the logits,
and the loss (and its gradient) equal the replicated computation's.

Two spawned processes on real gloo (``tests/ranks/tp_ranks.py``), one tensor-parallel group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.ranks.spawned_ranks import spawn_ranks
from tests.ranks.tp_ranks import SPEC, run_rank

VOCAB = SPEC.model.vocab_size


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, tuple[Any, ...]]:
    return spawn_ranks(run_rank, world_size=2, store_path=str(tmp_path_factory.mktemp("store") / "store"))


def test_each_tp_rank_holds_only_its_half_of_the_vocabulary(ranks):
    for rank in (0, 1):
        shape, placements, _, _, _, _, _ = ranks[rank]
        assert shape == (2, SPEC.seq_len, VOCAB // 2)
        assert placements == ["S(2)"]


def test_the_loss_is_a_plain_scalar_equal_to_the_replicated_one(ranks):
    for rank in (0, 1):
        _, _, loss_type, loss, reference, _, _ = ranks[rank]
        assert loss_type == "Tensor"  # the schedule and the step sum plain tensors
        assert abs(loss - reference) <= 1e-6


def test_each_rank_gets_its_shard_of_the_replicated_gradient(ranks):
    for rank in (0, 1):
        _, _, _, _, _, grad, reference_grad = ranks[rank]
        half = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
        torch.testing.assert_close(
            torch.from_numpy(grad), torch.from_numpy(reference_grad[..., half]), atol=1e-7, rtol=1e-5
        )
