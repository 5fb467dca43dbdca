"""Pipeline schedules and FSDP2 reshard/offload options train exactly like one process.

The placement rules are checked as plain values; the schedules themselves run in spawned gloo
processes (no Ray): 10 steps of the debug model, per-step losses against a 1-rank run of the
same model, seed and data within 1e-3 relative (the mean over data-parallel slices when dp > 1).
"""

from __future__ import annotations

import functools
import math

import pytest

from tests.unit.pipeline_ranks import STEPS, run_rank
from tests.unit.spawned_ranks import spawn_ranks
from workers.spec.pipeline import stage_ids


def test_loop_placement_puts_every_pp_th_stage_on_a_rank():
    assert [stage_ids("interleaved_1f1b", pp=4, pp_rank=r, stages_per_rank=2) for r in range(4)] == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
    ]
    assert stage_ids("1f1b", pp=4, pp_rank=2, stages_per_rank=1) == [2]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_placement_puts_stage_r_and_its_mirror_on_rank_r(schedule):
    # torch's generate_stage_to_rank_mapping(4, 8, style="v"): 0 1 2 3 3 2 1 0
    assert [stage_ids(schedule, pp=4, pp_rank=r, stages_per_rank=2) for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]


def _losses(mesh: dict[str, int], spec: dict[str, object], tmp_path) -> tuple[list[float], dict[int, list[int]]]:
    """Per-step loss (mean over data-parallel slices) and each rank's stage indices."""
    world_size = math.prod(mesh.values())
    outcomes = spawn_ranks(
        functools.partial(run_rank, mesh, spec), world_size=world_size, store_path=str(tmp_path / "store")
    )
    reported = [losses for losses, _ in outcomes.values() if losses is not None]
    assert len(reported) == mesh.get("dp_shard", 1) * mesh.get("dp_replicate", 1)
    mean = [sum(step) / len(step) for step in zip(*reported)]
    return mean, {rank: stages for rank, (_, stages) in outcomes.items()}


@pytest.fixture(scope="module")
def single_rank_losses(tmp_path_factory):
    losses, _ = _losses({"dp_shard": 1, "tp": 1, "pp": 1}, {}, tmp_path_factory.mktemp("single"))
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


LAYOUTS = {
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
def test_layout_losses_match_single_rank(layout, single_rank_losses, tmp_path):
    mesh, spec = LAYOUTS[layout]
    losses, stages = _losses(mesh, spec, tmp_path)
    assert losses == pytest.approx(single_rank_losses, rel=1e-3)
    if spec.get("pp_schedule") in ("zbv", "dualpipev"):
        assert stages[0] == [0, 3] and stages[1] == [1, 2]  # the V: rank 0 holds the first and last stage


def test_zero_bubble_with_tensor_parallel_matches_single_rank(single_rank_losses, tmp_path):
    losses, _ = _losses(
        {"dp_shard": 1, "tp": 2, "pp": 2}, {"pp_schedule": "zero_bubble", "stages_per_rank": 2}, tmp_path
    )
    assert losses == pytest.approx(single_rank_losses, rel=1e-3)
