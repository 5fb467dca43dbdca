"""``training.compile`` trains like eager: per-block torch.compile composed with every axis of a dense model.

Spawned gloo ranks (no Ray, ``tests/ranks/pipeline_ranks.py``), float32, 10 steps of the debug
model on pp2 x tp2 x dp_shard2 (FSDP2, sequence-parallel tensor parallelism and a pipeline
schedule around blocks compiled by inductor's C++ backend, activation checkpointing recomputing
them): per-step losses within 1e-3 relative of an eager single rank's, and the trained model's
logits. The compiled job of tests/faults/test_in_place_recovery.py shows dp_replicate2 x dp_shard2
against an eager run, through a SIGKILL. Mixtures of experts are refused with compile
(orchestrator/config_checks.py). CI's (slow): 8 ranks compiling take ~45 s of 2 cores.
"""

from __future__ import annotations

import pytest

from tests.ranks.pipeline_ranks import STEPS, Run, assert_trains_like, run_layout

SEQUENCE: dict[str, object] = {"seq_len": 64}


@pytest.fixture(scope="module")
def eager(tmp_path_factory) -> Run:
    run = run_layout({"dp_shard": 1, "tp": 1, "pp": 1}, SEQUENCE, tmp_path_factory.mktemp("eager"))
    assert len(run.losses) == STEPS and run.losses[-1] < run.losses[0]
    return run


COMPILED = {**SEQUENCE, "compile": True, "activation_checkpointing": True}


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_on_pp2_tp2_dp_shard2(eager, tmp_path):
    mesh = {"dp_shard": 2, "tp": 2, "pp": 2}
    assert_trains_like(run_layout(mesh, {**COMPILED, "microbatches": 4}, tmp_path), eager)
