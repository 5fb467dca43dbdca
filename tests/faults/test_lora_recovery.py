"""A LoRA run loses a rank and goes on in place with zero steps lost, like full training.

    python -m pytest tests/faults/test_lora_recovery.py -q

Real jobs on the session's Ray cluster (the demo model, two replica groups, adapters on the
attention projections). A rank of replica group 1 is killed at step 4; warm spares refill the
group: they draw the frozen base from the run's seed and receive the adapters and their
optimizer state from replica group 0. The run ends with the uninterrupted run's losses and
bitwise-equal replicas.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import ELASTIC_LAYOUT, assert_completed_like, of_kind, run_job
from tests.jobs import losses

STEPS = 8
LORA = ("model.lora={rank: 8, alpha: 16}", "training.lr=0.01", f"training.steps={STEPS}")


@pytest.mark.slow  # two 4-rank jobs: 20-40 s on 2 cores
def test_a_killed_rank_of_a_lora_run_is_refilled_in_place_with_no_step_lost(ray_cluster, tmp_path):
    result, events = run_job(tmp_path / "uninterrupted", *ELASTIC_LAYOUT, *LORA)
    assert result.exit_code == 0, result.reason
    reference = losses(events)
    assert reference[STEPS] < reference[1]  # the adapters train
    result, events = run_job(
        tmp_path / "killed", *ELASTIC_LAYOUT, *LORA, "elastic.spare_actors=2", faults=("kill@4:2",)
    )
    assert result.exit_code == 0, result.reason
    assert_completed_like(events, reference, STEPS)
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0
    assert recovered["new_mesh"]["dp_replicate"] == 2 and recovered["refilled_ranks"] == [2, 3]
    assert events[-1]["replicas_consistent"] is True
