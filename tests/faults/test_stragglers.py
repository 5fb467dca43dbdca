"""A rank slowed 4x (``slow@3:1:4``) is found from its compute time against its peer's and its
replica group's work moves to a warm spare at a step boundary: 0 steps lost, the losses of the
uninterrupted run, and the steps after the replacement as fast as those before the slowdown.
The policy's decisions (replace, exclude, warn) are fake-group tests: tests/unit/test_stragglers.py."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.faults.harness import assert_completed_like, of_kind, run_job
from tests.jobs import losses

STEPS = 14
SLOW_FROM = 3
# Two replica groups of one rank, one warm spare: the cheapest layout with a peer to compare with.
LAYOUT = (
    "parallelism.dp_replicate=2",
    "parallelism.dp_shard=1",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=64",
    "elastic.hang_timeout_s=8",
    "elastic.heartbeat_timeout_s=10",
    f"training.steps={STEPS}",
)


@pytest.mark.slow  # two 2-rank jobs (the reference, the slowed one with a spare)
def test_a_rank_slowed_4x_is_replaced_by_a_warm_spare_with_no_step_lost(ray_cluster, tmp_path):
    result, events = run_job(tmp_path / "uninterrupted", *LAYOUT)
    assert result.exit_code == 0, result.reason
    reference = losses(events)
    result, events = run_job(tmp_path / "slowed", *LAYOUT, "elastic.spare_actors=1", faults=(f"slow@{SLOW_FROM}:1:4",))
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS)
    assert not of_kind(events, "failure")
    [straggler] = of_kind(events, "straggler")
    assert straggler["rank"] == 1 and straggler["action"] == "replace" and straggler["factor"] > 2.0
    [drain] = of_kind(events, "drain")
    assert drain["ranks"] == [1] and drain["reason"] == "straggler"
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 2  # refilled
    steps = of_kind(events, "step")
    # The step in flight when the drain was asked ran on the old mesh; the next one on the spare.
    in_flight = next(e["step"] for e in steps if e["completed_at"] > drain["time"])
    assert in_flight + 1 - SLOW_FROM <= 10  # replaced within 10 steps of the slowdown
    # Step times go to the report, not into an assertion: on a shared 2-core machine a healthy
    # step varies 3x. Step 1 is in "before": with the state filled at configure it warms up little.
    step_time = {e["step"]: e["step_time_s"] for e in steps}
    figures = {
        "before_s": statistics.median(step_time[s] for s in range(1, SLOW_FROM)),
        "slowed_s": statistics.median(step_time[s] for s in range(SLOW_FROM, in_flight + 1)),
        "after_s": statistics.median(step_time[s] for s in range(in_flight + 2, STEPS + 1)),
        "first_replaced_step": in_flight + 1,
        "straggler_factor": straggler["factor"],
    }
    print(json.dumps(figures))
