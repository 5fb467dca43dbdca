"""Pipeline schedules and FSDP2 reshard/offload options train exactly like one process.

The schedules run in spawned gloo processes (no Ray, ``tests/ranks/pipeline_ranks.py``): 10 steps
of the debug model, per-step losses against a 1-rank run of the same model, seed and data within
1e-3 relative (the mean over data-parallel slices when dp > 1), then the trained model's logits
through the schedule's forward-only pass (what evaluation runs). Which stages each rank holds:
tests/unit/test_pipeline_schedules.py.
"""

from __future__ import annotations

import pytest

from tests.ranks.pipeline_ranks import STEPS, Run, assert_trains_like, run_layout


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> Run:
    run = run_layout({"dp_shard": 1, "tp": 1, "pp": 1}, {}, tmp_path_factory.mktemp("single"))
    assert len(run.losses) == STEPS and run.losses[-1] < run.losses[0]
    return run


LAYOUTS = {
    "pp2-interleaved_1f1b": (
        {"dp_shard": 1, "tp": 1, "pp": 2},
        {"pp_schedule": "interleaved_1f1b", "stages_per_rank": 2},
    ),
    "pp2-zero_bubble": ({"dp_shard": 1, "tp": 1, "pp": 2}, {"pp_schedule": "zero_bubble", "stages_per_rank": 2}),
    "pp2-zbv": ({"dp_shard": 1, "tp": 1, "pp": 2}, {"pp_schedule": "zbv", "stages_per_rank": 2}),
    "pp2-dualpipev-ac": (
        {"dp_shard": 1, "tp": 1, "pp": 2},
        {"pp_schedule": "dualpipev", "stages_per_rank": 2, "activation_checkpointing": True},
    ),
    "dp_shard2-pp2-zero_bubble": (
        {"dp_shard": 2, "tp": 1, "pp": 2},
        {"pp_schedule": "zero_bubble", "stages_per_rank": 2, "microbatches": 4},
    ),
    "dp_shard2-reshard_never": (
        {"dp_shard": 2, "tp": 1, "pp": 1},
        {"reshard_after_forward": "never", "microbatches": 4},
    ),
    "dp_shard2-pp2-reshard_always-offload": (
        {"dp_shard": 2, "tp": 1, "pp": 2},
        {"reshard_after_forward": "always", "cpu_offload": True, "microbatches": 4},
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_layout_trains_like_one_rank(layout, single_rank, tmp_path):
    mesh, spec = LAYOUTS[layout]
    run = run_layout(mesh, spec, tmp_path)
    assert_trains_like(run, single_rank)
    if spec.get("pp_schedule") in ("zbv", "dualpipev"):
        assert run.stages[0] == [0, 3] and run.stages[1] == [1, 2]  # the V: rank 0 holds the first and last stage


def test_an_uneven_fsdp_split_trains_like_one_rank(tmp_path):
    """Three dp_shard ranks: the embedding (256 rows) and the attention weights (64 rows) do not
    split evenly by 3, so FSDP2 pads the last shard; the batch of 12 gives each rank 4 samples in
    2 microbatches."""
    batch = {"global_batch": 12, "microbatches": 2}
    (tmp_path / "one").mkdir()
    (tmp_path / "three").mkdir()
    one = run_layout({"dp_shard": 1, "tp": 1, "pp": 1}, batch, tmp_path / "one")
    three = run_layout({"dp_shard": 3, "tp": 1, "pp": 1}, batch, tmp_path / "three")
    assert_trains_like(three, one)
    assert one.losses[-1] < one.losses[0]


def test_zero_bubble_with_tensor_parallel_trains_like_one_rank(single_rank, tmp_path):
    run = run_layout({"dp_shard": 1, "tp": 2, "pp": 2}, {"pp_schedule": "zero_bubble", "stages_per_rank": 2}, tmp_path)
    assert_trains_like(run, single_rank)
