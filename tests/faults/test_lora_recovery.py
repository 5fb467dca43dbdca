"""A LoRA run loses a rank and goes on in place with zero steps lost, like full training.

    python -m pytest tests/faults/test_lora_recovery.py -q -m "slow or not slow"

Real jobs on the session's Ray cluster (the demo model, adapters on the attention projections).
Two replica groups: a rank of replica group 1 is killed at step 4; warm spares refill the group:
they draw the frozen base from the run's seed and receive the adapters and their optimizer state
from replica group 0. One replica group: the lost rank's adapters come from its buddy's memory
snapshot, which holds the adapters only. Each run ends with the uninterrupted run's losses: one
uninterrupted run on four data-parallel ranks serves both (the same global batch and sequences on
either layout, so the same math).
"""

from __future__ import annotations

import pytest

from orchestrator.config import load_config
from tests.faults.harness import ELASTIC_LAYOUT, ONE_REPLICA, assert_completed_like, of_kind, run_job
from tests.jobs import DEMO_CONFIG, losses

STEPS = 8
LORA = ("model.lora={rank: 8, alpha: 16}", "training.lr=0.01", f"training.steps={STEPS}")


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> dict[int, float]:
    """The losses of the uninterrupted one-replica LoRA run (dp_shard=4)."""
    result, events = run_job(tmp_path_factory.mktemp("uninterrupted"), *ONE_REPLICA, *LORA)
    assert result.exit_code == 0, result.reason
    reference = losses(events)
    assert reference[STEPS] < reference[1]  # the adapters train
    return reference


@pytest.mark.slow  # a 4-rank job (and the shared reference): 15-30 s on 2 cores
def test_a_killed_rank_of_a_lora_run_is_refilled_in_place_with_no_step_lost(reference, tmp_path):
    result, events = run_job(
        tmp_path, *ELASTIC_LAYOUT, "training.seq_len=32", *LORA, "elastic.spare_actors=2", faults=("kill@4:2",)
    )
    assert result.exit_code == 0, result.reason
    # dp_replicate=2 x dp_shard=2 against the dp_shard=4 reference: 4 data-parallel ranks either way.
    assert_completed_like(events, reference, STEPS)
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0
    assert recovered["new_mesh"]["dp_replicate"] == 2 and recovered["refilled_ranks"] == [2, 3]
    assert events[-1]["replicas_consistent"] is True


@pytest.mark.slow  # a 4-rank job (and the shared reference): 15-30 s on 2 cores
def test_a_lost_rank_of_a_lora_run_is_rebuilt_from_snapshots_of_the_adapters_only(reference, tmp_path):
    result, events = run_job(tmp_path, *ONE_REPLICA, *LORA, "elastic.spare_actors=4", faults=("kill@4:3",))
    assert result.exit_code == 0, result.reason
    [restored] = of_kind(events, "restored")
    assert restored["source"] == "peer_memory" and restored["step"] == 3  # no step lost
    [recovered] = of_kind(events, "recovered")
    assert recovered["lost_steps"] == 0
    # Same mesh, same adapters, the base drawn again from the seed: the same losses, to the bit.
    partial = {e["step"] for e in of_kind(events, "step") if e.get("loss_partial")}
    expected = {step: loss for step, loss in reference.items() if step not in partial}
    assert {step: loss for step, loss in losses(events).items() if step not in partial} == expected
    # A snapshot holds the adapters and their Adam moments, no base weight: full training's holds
    # each rank's float32 weights and two moments (3x the weights); this one, under a third of
    # the weights alone (a ninth of full training's), even at rank 8 on this tiny model.
    memory = of_kind(events, "snapshot_memory")[0]
    weights_per_rank = 4 * load_config(DEMO_CONFIG, list(ONE_REPLICA)).model_spec.num_params / 4
    per_snapshot = memory["max_bytes"] / 4  # a rank holds 2 of its own and 2 of its buddy's
    assert 0 < per_snapshot < weights_per_rank / 3
