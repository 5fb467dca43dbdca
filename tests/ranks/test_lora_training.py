"""LoRA trains the same on any mesh, and only the adapters train.

    python -m pytest tests/ranks/test_lora_training.py -q

Spawned gloo ranks (no Ray, ``tests/ranks/lora_ranks.py``): 10 steps of the debug model with
adapters on all seven linear layers of every block, per-step losses of one rank against
pp2 x tp2 x dp_shard2 within 1e-3 relative, then the trained model's logits. On every rank the
frozen base is bit-identical after training and nothing but the adapters has a gradient,
optimizer state or a place in what checkpoints and snapshots save.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from tests.ranks.lora_ranks import STEPS, run_rank
from tests.ranks.spawned_ranks import spawn_ranks


def _run(mesh: dict[str, int], tmp_path) -> dict[int, tuple]:
    return spawn_ranks(
        functools.partial(run_rank, mesh, {}), world_size=math.prod(mesh.values()), store_path=str(tmp_path / "store")
    )


def _losses(outcomes: dict[int, tuple]) -> list[float]:
    reported = [losses for losses, *_ in outcomes.values() if losses is not None]
    return [sum(step) / len(step) for step in zip(*reported)]


def _assert_only_adapters_train(outcomes: dict[int, tuple]) -> None:
    for rank, (_, _, base_unchanged, with_grad, with_state, saved) in outcomes.items():
        assert base_unchanged, f"rank {rank} changed a frozen base weight"
        assert with_grad and all(".lora_" in name for name in with_grad), with_grad
        assert with_state == with_grad  # optimizer state for the adapters, none for the base
        assert saved and all(".lora_" in name for name in saved), saved


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> dict[int, tuple]:
    return _run({"dp_shard": 1}, tmp_path_factory.mktemp("single"))


def test_one_rank_trains_the_adapters_only(single_rank):
    _assert_only_adapters_train(single_rank)
    losses = _losses(single_rank)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    (_, _, _, with_grad, _, saved) = single_rank[0]
    assert len(with_grad) == 2 * 7 * 4  # A and B of 7 layers in each of the debug model's 4 blocks
    assert saved == sorted(
        with_grad + [f"optim.{name}.{key}" for name in with_grad for key in ("exp_avg", "exp_avg_sq", "step")]
    )


def test_pp2_tp2_dp_shard2_trains_like_one_rank(single_rank, tmp_path):
    run = _run({"dp_shard": 2, "tp": 2, "pp": 2}, tmp_path)
    _assert_only_adapters_train(run)
    assert _losses(run) == pytest.approx(_losses(single_rank), rel=1e-3)
    logits = [held for _, held, *_ in run.values() if held is not None]
    assert logits
    for held in logits:
        np.testing.assert_allclose(held, single_rank[0][1], rtol=1e-3, atol=1e-4)
