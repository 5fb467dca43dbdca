"""The chaos schedule: the same seed draws the same faults; /configure faults follow a recovery's step."""

from __future__ import annotations

from orchestrator.driver.chaos import chaos_kinds, chaos_schedule
from workers.faults import CONFIGURE_KINDS, SLOW_FACTOR, FaultKind, FaultPhase, FaultSpec

KINDS = chaos_kinds(storage=True, nodes=True)


def schedule(seed: int, count: int = 9):
    return chaos_schedule(seed, count, steps=60, world_size=4, replica_size=2, kinds=KINDS)


def test_a_seed_replays_exactly_and_another_seed_differs():
    assert schedule(366) == schedule(366)
    assert schedule(366) != schedule(367)


def test_faults_keep_off_start_up_and_the_last_step_and_configure_faults_follow_a_recovery():
    for seed in range(50):
        faults = schedule(seed)
        assert len(faults) == 9
        assert all(3 <= fault.step <= 59 and 0 <= fault.rank < 4 for fault in faults)
        step_faults = [fault for fault in faults if fault.phase == FaultPhase.STEP]
        assert len({fault.step for fault in step_faults}) == len(step_faults)  # distinct steps
        for index, fault in enumerate(faults):
            if fault.phase == FaultPhase.CONFIGURE:
                before = faults[index - 1]
                assert fault.kind in CONFIGURE_KINDS and fault.rank < 2  # a rank every later mesh has
                redone = before.kind in (FaultKind.KILL, FaultKind.RAISE, FaultKind.HANG)
                assert fault.step == (before.step if redone else before.step + 1)


def test_without_storage_or_nodes_no_outage_drain_or_node_fault_is_drawn():
    kinds = chaos_kinds(storage=False, nodes=False)
    faults = [
        f for seed in range(30) for f in chaos_schedule(seed, 6, steps=30, world_size=4, replica_size=2, kinds=kinds)
    ]
    in_ranks = {FaultKind.KILL, FaultKind.RAISE, FaultKind.HANG, FaultKind.SIGTERM, FaultKind.SLOW}
    assert {f.kind for f in faults} <= in_ranks


def test_a_drawn_straggler_is_slowed_by_the_default_factor_and_replays_as_written():
    faults = [f for seed in range(30) for f in schedule(seed, 9) if f.kind == FaultKind.SLOW]
    assert faults and all(f.factor == SLOW_FACTOR for f in faults)
    assert all(FaultSpec.parse(f.describe()) == f for f in faults)
