"""``training.compile`` trains like eager: per-block torch.compile composed with every axis.

Spawned gloo ranks (no Ray, ``tests/ranks/pipeline_ranks.py``), float32, 10 steps of the debug
model: per-step losses within 1e-3 relative of an eager single rank's, and the trained model's
logits, compiled with inductor's C++ backend, on one rank and on pp2 x tp2 x dp_shard2 (FSDP2,
sequence-parallel tensor parallelism and a pipeline schedule around compiled blocks).
"""

from __future__ import annotations

import pytest

from tests.ranks.pipeline_ranks import STEPS, Run, assert_trains_like, run_layout


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> Run:
    run = run_layout({"dp_shard": 1, "tp": 1, "pp": 1}, {}, tmp_path_factory.mktemp("eager"))
    assert len(run.losses) == STEPS and run.losses[-1] < run.losses[0]
    return run


def test_compiled_blocks_train_like_eager_on_one_rank(eager, tmp_path):
    assert_trains_like(run_layout({"dp_shard": 1, "tp": 1, "pp": 1}, {"compile": True}, tmp_path), eager)


def test_compiled_blocks_train_like_eager_on_pp2_tp2_dp_shard2(eager, tmp_path):
    mesh = {"dp_shard": 2, "tp": 2, "pp": 2}
    assert_trains_like(run_layout(mesh, {"compile": True, "microbatches": 4}, tmp_path), eager)
