"""bench/chaos.py's arithmetic, from small synthetic runs: goodput over the steps that count (a step a
restore rewound counts once, by its redo), steps lost apart for restores from storage, faults landed
as failure plus drain events, the goals judged from those, and the Ray Train reference's restarts."""

from __future__ import annotations

import pytest

from bench.support.chaos_figures import (
    chaos_figures,
    goals,
    reference_goodput,
    reference_restarts,
    split_for_reference,
    time_breakdown,
)
from workers.faults import FaultSpec


def step(number: int, at: float, step_time_s: float = 1.0) -> dict:
    return {"event": "step", "step": number, "time": at, "step_time_s": step_time_s}


def recovered(cause: str, lost_steps: int, mttr_s: float) -> dict:
    return {"event": "recovered", "cause": cause, "lost_steps": lost_steps, "mttr_s": mttr_s}


CHAOS = [
    {"event": "start", "time": 0.0},
    *(step(n, float(n)) for n in range(1, 5)),
    {"event": "failure", "kind": "rank_died"},
    recovered("failure", 0, 1.5),  # a replica group survived: in place
    step(5, 6.0),
    {"event": "drain", "reason": "node draining"},
    recovered("drain", 0, 0.5),
    step(6, 8.0),
    {"event": "checkpoint_failed", "step": 6, "reason": "storage"},  # the outage: no failure event
    {"event": "failure", "kind": "node_lost"},
    {"event": "restored", "step": 3},  # no replica group survived: steps 4-6 are redone
    recovered("restore", 3, 9.0),
    *(step(n, 14.0 + n, step_time_s=0.5) for n in (4, 5, 6)),
    step(7, 18.0),
    step(8, 19.0),
    {"event": "done", "time": 20.0, "status": "finished", "steps": 8},
]
# 8 steps of 0.8125 s in 10 s: 65% goodput.
UNINTERRUPTED = [
    {"event": "start", "time": 0.0},
    *(step(n, float(n), step_time_s=0.8125) for n in range(1, 9)),
    {"event": "done", "time": 10.0, "status": "finished", "steps": 8},
]


def test_goodput_counts_a_step_a_restore_rewound_once_by_its_redo():
    figures = chaos_figures(CHAOS, scheduled=5, survived=True, uninterrupted=UNINTERRUPTED)
    # steps 1-3 (1 s each), the redo of 4-6 (0.5 s each), 7-8 (1 s each) over 20 s of wall time
    assert figures["goodput"] == {
        "goodput": 0.325,
        "useful_s": 6.5,
        "wall_s": 20.0,
        "steps_counted": 8,
        "step_events": 11,
    }
    assert figures["uninterrupted_goodput"]["goodput"] == 0.65
    assert figures["goodput_ratio_vs_uninterrupted"] == 0.5


def test_steps_lost_are_split_by_whether_a_replica_survived():
    figures = chaos_figures(CHAOS, scheduled=5, survived=True, uninterrupted=None)
    assert figures["steps_lost"] == {
        "replica_survived": 0,
        "from_peer_memory": 0,
        "from_storage": 3,
        "total": 3,
        "redone_after_restores": 3,
        "recoveries_replica_survived": 2,
        "recoveries_from_peer_memory": 0,
        "recoveries_from_storage": 1,
    }
    assert figures["restores_from_storage"] == 1 and figures["restores_from_peer_memory"] == 0
    assert figures["slowest_recovery"] == {"mttr_s": 9.0, "cause": "restore"}
    assert figures["goodput_ratio_vs_uninterrupted"] is None


def test_the_steps_redone_are_counted_from_the_step_events_beside_the_recovered_events():
    # One restore reported twice (as a chaos run once showed, the first time before it happened):
    # the recovered events say 6 steps, the step events 3.
    twice = [*CHAOS[:13], recovered("restore", 3, -4.8), *CHAOS[13:]]
    lost = chaos_figures(twice, scheduled=5, survived=True, uninterrupted=None)["steps_lost"]
    assert (lost["from_storage"], lost["redone_after_restores"]) == (6, 3)


def test_faults_landed_are_failure_and_drain_events_and_survived_only_when_every_invariant_held():
    figures = chaos_figures(CHAOS, scheduled=5, survived=True, uninterrupted=None)
    assert figures["faults_landed"] == {
        "total": 3,
        "failure_events": 2,
        "drain_events": 1,
        "by_kind": {"drain (node draining)": 1, "node_lost": 1, "rank_died": 1},
        "saves_failed_on_storage": 1,
    }
    assert figures["faults_scheduled"] == 5 and figures["faults_survived"] == 3
    assert chaos_figures(CHAOS, scheduled=5, survived=False, uninterrupted=None)["faults_survived"] is None


def test_goals():
    figures = chaos_figures(CHAOS, scheduled=5, survived=True, uninterrupted=None)
    assert goals(figures, survived=True) == {
        "every_fault_survived": True,
        "0_steps_lost_where_a_replica_survived": True,
        "goodput>=80%": False,
    }
    lost_in_place = [*CHAOS[:5], recovered("failure", 1, 1.0), *CHAOS[6:]]
    assert not goals(chaos_figures(lost_in_place, scheduled=5, survived=True, uninterrupted=None), survived=True)[
        "0_steps_lost_where_a_replica_survived"
    ]


def done_step(number: int, completed_at: float, step_time_s: float = 1.0) -> dict:
    return {**step(number, completed_at + 0.1, step_time_s), "completed_at": completed_at}


def test_the_wall_time_splits_into_steps_start_end_hang_waits_recoveries_and_the_gaps_between_steps():
    events = [
        {"event": "start", "time": 0.0},
        done_step(1, 3.0),  # began at 2: 2 s of start
        done_step(2, 4.25),  # 0.25 s between steps
        {"event": "failure", "kind": "hang", "time": 12.25},  # 8 s waiting for the hang timeout
        {"event": "recovered", "cause": "failure", "lost_steps": 0, "mttr_s": 1.5, "time": 13.75},
        done_step(3, 14.75),  # began at 13.75: 1.5 s of recovery after the hang was found
        {"event": "failure", "kind": "node_lost", "time": 15.0},
        {"event": "restored", "step": 2, "time": 16.5},
        done_step(3, 17.5, step_time_s=0.5),  # the redo of step 3 (began at 17): 2.25 s of recovery
        done_step(4, 18.5),
        {"event": "done", "time": 19.0, "status": "finished", "steps": 4},
    ]
    parts = time_breakdown(events)
    assert parts == {
        "wall_s": 19.0,
        "start_s": 2.0,
        "end_s": 0.5,
        "useful_s": 3.5,
        "redone_s": 1.0,
        "hang_wait_s": 8.0,
        "recovery_s": 3.75,
        "between_steps_s": 0.25,
    }
    assert sum(value for name, value in parts.items() if name != "wall_s") == pytest.approx(parts["wall_s"])
    assert chaos_figures(events, scheduled=2, survived=True, uninterrupted=None)["time_breakdown"] == parts
    assert time_breakdown(CHAOS) is None  # step events without completed_at (older runs)


def test_ray_train_meets_kill_raise_and_node_at_a_step_and_the_rest_is_said_not_applied():
    schedule = [FaultSpec.parse(text) for text in ("kill@5:1", "hang@6:0", "raise@6:0/configure", "node@6:0")]
    applied, not_applied = split_for_reference([*schedule, FaultSpec.parse("raise@9:1")])
    assert applied == [
        {"kind": "kill", "step": 5, "rank": 1},
        {"kind": "node", "step": 6, "rank": 0},
        {"kind": "raise", "step": 9, "rank": 1},
    ]
    assert sorted(not_applied) == ["hang@6:0", "raise@6:0/configure"]
    assert all(why for why in not_applied.values())


def record(kind: str, rank: int, attempt: int, at: float, **fields) -> dict:
    return {"kind": kind, "rank": rank, "attempt": attempt, "time": at, **fields}


def attempt_records(attempt: int, started: float, resumed_from: int, steps: dict[int, tuple[float, float]]) -> list:
    """Both workers of an attempt: the start, then each step (completed at, step time)."""
    records = [record("start", rank, attempt, started, resumed_from=resumed_from) for rank in (0, 1)]
    for number, (at, step_time_s) in steps.items():
        records += [
            record("step", rank, attempt, at, step=number, completed_at=at, step_time_s=step_time_s) for rank in (0, 1)
        ]
    return records


def test_each_ray_train_restart_is_timed_from_its_fault_and_counts_the_steps_redone():
    kill, node = {"kind": "kill", "step": 5, "rank": 1}, {"kind": "node", "step": 6, "rank": 0}
    records = [
        *attempt_records(1, 0.0, 0, {n: (float(n), 1.0) for n in range(1, 5)}),
        record("kill", 1, 1, 4.5, fault=0),
        *attempt_records(2, 10.0, 3, {4: (12.0, 0.5), 5: (13.0, 0.5), 6: (14.0, 0.5)}),  # from checkpoint 3
        *attempt_records(3, 20.0, 6, {7: (22.0, 1.0), 8: (23.0, 1.0)}),
    ]
    restarts = reference_restarts(records, [(node, 14.5), (kill, 4.5)], world_size=2)
    assert restarts == [
        {"fault": "kill@5:1", "restart_s": 7.5, "lost_steps": 1, "resumed_from": 3},
        {"fault": "node@6:0", "restart_s": 7.5, "lost_steps": 0, "resumed_from": 6},
    ]
    figures = reference_goodput(records, wall_s=26.0, world_size=2)
    assert figures["goodput"] == pytest.approx(6.5 / 26) and figures["steps_counted"] == 8
