"""Pipeline schedules place their stages on the ranks as torch's schedules expect, checked as
plain values.

The schedules trained against one process in spawned gloo ranks: tests/ranks/test_pipeline_training.py.
"""

from __future__ import annotations

import pytest

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
