"""bench/parallel.py measures what it says: each pipeline rank's idle fraction, next to the formula.

Its ranks are spawned gloo processes (no Ray), as in the benchmark itself.
"""

from __future__ import annotations

import pytest

from bench.parallel import WARMUP_STEPS, measure, measure_experts


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_bubble_is_measured_per_rank_next_to_the_formula(schedule):
    case = {
        "pp": 2,
        "schedule": schedule,
        "steps": WARMUP_STEPS + 1,
        "microbatches": 4,
        "microbatch_size": 1,
        "seq_len": 16,
        "threads": 1,
    }
    row = measure(case)
    assert row["stages_per_rank"] == (1 if schedule == "1f1b" else 2)
    assert len(row["measured_bubble_per_rank"]) == 2
    # A fraction of the step: the ranks computed (not 1.0) and the timing is not above the step's.
    assert all(0.0 <= idle < 1.0 for idle in row["measured_bubble_per_rank"])
    # 1F1B: (p - 1) / (m + p - 1); ZB-V: none with m >= 2p - 1 microbatches.
    assert row["formula_bubble"] == pytest.approx(1 / 5 if schedule == "1f1b" else 0.0, abs=1e-4)


def test_expert_parallel_throughput_is_measured_for_ep1_and_ep2_side_by_side():
    case = {"steps": WARMUP_STEPS + 1, "global_batch": 2, "seq_len": 16, "threads": 1}
    row = measure_experts(case, rounds=1)
    assert len(row["step_s_ep1"]) == len(row["step_s_ep2"]) == 1 and min(row["step_s_ep1"] + row["step_s_ep2"]) > 0
    assert row["tokens_per_step"] == 32
    # The JSON rounds tokens/s to 0.1 and step times to 0.1 ms: compare within that rounding.
    assert row["tokens_per_s_ep1"] == pytest.approx(32 / row["step_s_ep1"][0], rel=1e-2, abs=0.1)
    assert row["ratio_ep2_over_ep1"] == pytest.approx(row["tokens_per_s_ep2"] / row["tokens_per_s_ep1"], rel=1e-2)
