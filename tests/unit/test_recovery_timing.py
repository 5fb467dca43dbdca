"""Recovery timing: the benchmark's arithmetic (which step ends a recovery, what counts as lost)
and the driver's own ``recovered`` event."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.support.recovery_timing import completions_by_attempt, mesh_change, ratio, restart_from_records
from elastic.spec import MeshSpec
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.transitions import TransitionKind, TransitionTimer
from orchestrator.observe.events import EventLog, read_events

TWO = {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1}
ONE = {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "cp": 1}


def step(number: int, at: float, mesh: dict) -> dict:
    return {"event": "step", "step": number, "completed_at": at, "mesh": mesh}


def test_a_kill_ends_at_the_first_step_on_the_smaller_mesh_with_nothing_lost():
    events = [step(n, 100.0 + n, TWO) for n in range(1, 8)] + [
        {"event": "failure", "kind": "rank_died"},
        step(8, 109.5, ONE),
        {"event": "recovered", "new_mesh": ONE, "mttr_s": 1.2},
        step(9, 110.0, ONE),
    ]
    change = mesh_change(events, after_event="failure", new_mesh_event="recovered", began_at=107.01)
    assert change.first_step == 8
    assert change.to_first_step_s == pytest.approx(2.49)
    assert change.lost_steps == 0


def test_steps_redone_after_the_fault_count_as_lost():
    events = [step(n, 100.0 + n, TWO) for n in range(1, 8)] + [
        {"event": "failure"},
        step(6, 115.0, ONE),
        {"event": "recovered", "new_mesh": ONE},
    ]
    change = mesh_change(events, after_event="failure", new_mesh_event="recovered", began_at=107.5)
    assert change.first_step == 6 and change.lost_steps == 2


def test_a_drain_pauses_between_the_last_old_step_and_the_first_new_one():
    events = [step(n, 100.0 + n, TWO) for n in range(1, 8)] + [
        {"event": "drain", "ranks": [2, 3]},
        step(8, 108.0, TWO),  # the step in flight finishes on the old mesh
        {**step(9, 108.7, ONE), "step_time_s": 0.5},
        {"event": "recovered", "new_mesh": ONE},
    ]
    change = mesh_change(events, after_event="drain", new_mesh_event="recovered", began_at=107.0)
    assert change.first_step == 9 and change.last_step_before == 8
    assert change.pause_s == pytest.approx(0.7)
    assert change.idle_s == pytest.approx(0.2)  # no step ran for 0.2 s
    assert change.lost_steps == 0


def test_the_first_step_on_the_new_mesh_compares_to_the_later_steps_on_it():
    events = [{**step(n, 100.0 + n, TWO), "step_time_s": 0.3} for n in range(1, 8)] + [
        {"event": "failure"},
        {**step(8, 109.0, ONE), "step_time_s": 0.9},
        {"event": "recovered", "new_mesh": ONE},
        *({**step(n, 101.0 + n, ONE), "step_time_s": 0.4 + n / 100} for n in (9, 10, 11)),
    ]
    change = mesh_change(events, after_event="failure", new_mesh_event="recovered", began_at=107.5)
    assert change.first_step_time_s == 0.9
    assert change.steady_step_time_s == pytest.approx(0.5)  # the median of steps 9-11, not the old mesh's 0.3 s


def test_a_grow_after_a_shrink_ends_on_the_grown_mesh_not_the_original_one():
    events = [
        step(1, 101.0, TWO),
        {"event": "failure"},
        step(2, 103.0, ONE),
        {"event": "recovered", "new_mesh": ONE},
        step(3, 104.0, ONE),
        step(4, 105.0, ONE),
        step(5, 107.5, TWO),
        {"event": "grow", "new_mesh": TWO},
    ]
    change = mesh_change(events, after_event="recovered", new_mesh_event="grow", began_at=104.5)
    assert change.first_step == 5 and change.to_first_step_s == pytest.approx(3.0)


def test_no_step_on_the_new_mesh_is_an_error_naming_the_mesh():
    events = [step(1, 101.0, TWO), {"event": "failure"}, {"event": "recovered", "new_mesh": ONE}]
    with pytest.raises(ValueError, match="no step completed on the new mesh"):
        mesh_change(events, after_event="failure", new_mesh_event="recovered", began_at=101.5)


def record(kind: str, rank: int, attempt: int, **fields) -> dict:
    return {"kind": kind, "rank": rank, "attempt": attempt, **fields}


def test_a_ray_train_restart_redoes_the_steps_since_its_checkpoint():
    records = []
    for rank in range(2):
        records.append(record("start", rank, 1, resumed_from=0, time=100.0))
        records += [record("step", rank, 1, step=n, completed_at=100.0 + n + rank * 0.01) for n in range(1, 8)]
    records.append(record("kill", 1, 1, time=107.5))
    for rank in range(2):
        records.append(record("start", rank, 2, resumed_from=5, time=130.0 + rank))
        records += [record("step", rank, 2, step=n, completed_at=126.0 + n + rank * 0.01) for n in range(6, 10)]
    restart = restart_from_records(records, fault_at=107.5, world_size=2)
    assert restart.last_step_before == 7 and restart.resumed_from == 5 and restart.lost_steps == 2
    assert restart.to_first_step_s == pytest.approx(132.01 - 107.5)  # step 6, slowest rank
    assert restart.to_new_progress_s == pytest.approx(134.01 - 107.5)  # step 8: beyond where it was
    assert restart.to_workers_ready_s == pytest.approx(131.0 - 107.5)


def test_a_step_only_some_ranks_completed_is_not_a_completed_step():
    records = [
        record("step", 0, 1, step=1, completed_at=1.0),
        record("step", 1, 1, step=1, completed_at=1.2),
        record("step", 0, 1, step=2, completed_at=2.0),
    ]
    assert completions_by_attempt(records, world_size=2) == {1: {1: 1.2}}


def test_ratio_is_how_many_times_longer_the_reference_took():
    assert ratio(30.0, 2.0) == 15.0
    assert ratio(None, 2.0) is None and ratio(30.0, None) is None


def test_the_driver_reports_a_recovery_once_at_the_first_step_after_its_resume_step(tmp_path: Path) -> None:
    two, one = MeshSpec.from_dict(TWO), MeshSpec.from_dict(ONE)
    events = EventLog(tmp_path / "events.jsonl")
    router = ReportRouter(events, mesh=one, tokens_per_step=1)
    timer = TransitionTimer(events, router)
    timer.begin(
        TransitionKind.RECOVERED,
        began_at=0.0,
        old_mesh=two,
        new_mesh=one,
        resume_step=7,
        lost_steps=1,
        cause="failure",
        added_ranks=(1,),
    )
    assert timer.pending is not None
    began_wall = timer.pending.began_wall
    router.last_emitted_step = 7
    timer.report()
    assert timer.pending is not None  # step 7 is the resume step, not a step on the new mesh
    router.last_emitted_step, router.completed_at[8] = 8, began_wall + 2.5
    router.steps_emitted += 1
    timer.report()
    timer.report()
    recovered = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "recovered"]
    assert len(recovered) == 1 and timer.pending is None
    assert recovered[0]["mttr_s"] == pytest.approx(2.5, abs=0.01) and recovered[0]["lost_steps"] == 1
    assert recovered[0]["cause"] == "failure" and recovered[0]["refilled_ranks"] == [1]
    assert recovered[0]["new_mesh"] == ONE and recovered[0]["old_mesh"] == TWO


def test_a_restore_is_not_reported_before_a_step_completes_on_the_restored_mesh(tmp_path: Path) -> None:
    """Regression: a restore of step 30 begun after step 36 was reported at once (mttr_s < 0): the
    router still counted steps 31-36 as done until the restored ranks rewound it."""
    two, one = MeshSpec.from_dict(TWO), MeshSpec.from_dict(ONE)
    events = EventLog(tmp_path / "events.jsonl")
    router = ReportRouter(events, mesh=one, tokens_per_step=1)
    router.last_emitted_step, router.steps_emitted = 36, 36
    timer = TransitionTimer(events, router)
    timer.begin(
        TransitionKind.RECOVERED,
        began_at=0.0,
        old_mesh=two,
        new_mesh=one,
        resume_step=30,
        lost_steps=6,
        cause="restore",
    )
    timer.report()
    assert timer.pending is not None and not [e for e in read_events(tmp_path / "events.jsonl")]
    router.rewind(30)
    router.last_emitted_step, router.steps_emitted = 31, 37
    router.completed_at[31] = timer.pending.began_wall + 4.0
    timer.report()
    [recovered] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "recovered"]
    assert recovered["mttr_s"] == pytest.approx(4.0, abs=0.01) and recovered["lost_steps"] == 6
