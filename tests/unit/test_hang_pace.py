"""The hang threshold follows the job's own pace (driver side, a fake clock, no Ray)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.driver.detector import FIRST_STEP_ALLOWANCE_S, UNWIND_FLOOR_S, WARMUP_FLOOR_S, Detector, LossKind
from tests.unit.fake_group import ELASTIC, events_of, finish


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced(clock: Clock, step_times: list[float], *, floor_s: float = 2.0, world_size: int = 2) -> Detector:
    """A detector whose generation started after step 0 and completed one step per entry of
    ``step_times`` (the first one is the generation's warm-up)."""
    found = Detector(heartbeat_timeout_s=1e9, hang_timeout_s=floor_s, clock=clock)
    found.reset(world_size, step=0)
    for step, seconds in enumerate(step_times, start=1):
        clock.now += seconds
        found.stepped(step, step_time_s=seconds)
    return found


def stall_until_hung(found: Detector, clock: Clock, *, tick_s: float = 0.05, limit_s: float = 600.0) -> float:
    """Seconds from the last step to the moment the busy rank is blamed (rank 1 busy, rank 0 waits)."""
    found.heard(0, waiting=True, where="all_reduce")
    found.heard(1, waiting=False, where="model.py:10")
    started = clock.now
    while found.hung() is None:
        clock.now += tick_s
        assert clock.now - started < limit_s, "never declared"
    assert found.hung() == [1]
    return clock.now - started


def test_a_fast_jobs_hang_is_declared_in_a_few_of_its_steps_not_the_floor_of_old() -> None:
    clock = Clock()
    # A chaos-soak-like job: 0.5-0.9 s steps after a 6 s first step.
    found = paced(clock, [6.0] + [0.5, 0.7, 0.9, 0.6, 0.8] * 4)
    assert found.pace_s() == 0.9  # the warm-up step is not part of the pace
    declared = stall_until_hung(found, clock)
    assert 3.6 <= declared <= 3.7  # 4 x p90 = 3.6 s: well within 5 s
    loss = found.hang_losses()[1]
    assert loss.kind == LossKind.HANG and "4 x the recent p90 step time" in loss.message


def test_the_floor_holds_for_tiny_steps_and_large_steps_scale_the_threshold() -> None:
    clock = Clock()
    tiny = paced(clock, [1.0] + [0.01] * 10)
    assert tiny.hang_threshold_s() == 2.0  # elastic.hang_timeout_s is the floor
    slow = paced(clock, [30.0] + [8.0, 9.0, 10.0] * 5)
    assert slow.hang_threshold_s() == 40.0  # a large model's 10 s steps are not hangs at 2 s
    assert stall_until_hung(slow, clock, tick_s=0.5) == 40.5


def test_one_slow_outlier_lifts_the_threshold_only_for_the_next_steps_but_a_slower_pace_for_good() -> None:
    clock = Clock()
    found = paced(clock, [5.0] + [1.0] * 19 + [9.0])  # one 9 s hiccup among 1 s steps
    assert found.hang_threshold_s() == 18.0  # the pace may have changed at once: 2 x the latest 9 s
    for step in range(22, 25):
        clock.now += 1.0
        found.stepped(step, step_time_s=1.0)
    assert found.hang_threshold_s() == 4.0  # it had not: p90 ignores the worst two of twenty
    for step in range(25, 33):  # the machine gets busier: steps take 2 s
        clock.now += 2.0
        found.stepped(step, step_time_s=2.0)
    assert found.hang_threshold_s() == 8.0


def test_steps_that_slow_down_at_once_are_not_taken_for_a_hang() -> None:
    """The chaos soak's false hang: 0.2 s steps, then (replacement actors starting on the same
    cores) two 3 s steps; the next 3 s step is no hang, a stall of twice that is."""
    clock = Clock()
    found = paced(clock, [4.0] + [0.2] * 19 + [3.0, 3.0])
    assert found.pace_s() == 0.2
    assert found.hang_threshold_s() == 6.0
    assert 6.0 <= stall_until_hung(found, clock) <= 6.1


def test_the_first_step_of_each_generation_gets_a_warm_up_allowance() -> None:
    clock = Clock()
    fresh = Detector(heartbeat_timeout_s=1e9, hang_timeout_s=2.0, clock=clock)
    fresh.reset(2, step=0)
    assert fresh.hang_threshold_s() == FIRST_STEP_ALLOWANCE_S  # nothing known of the pace yet
    found = paced(clock, [6.0] + [0.5] * 10)
    found.reset(2, step=11)  # a mesh change: step 12 is the new generation's first
    assert found.hang_threshold_s() == WARMUP_FLOOR_S
    clock.now += 9.0  # a slow first step of the new mesh is no hang
    assert found.hung() is None
    found.stepped(12, step_time_s=9.0)
    # Not part of the pace; the next steps may be as slow (the chaos soak's second step after a
    # restore took 2.2 s after a 2.8 s first one): twice it, until three steps went by.
    assert found.pace_s() == 0.5 and found.hang_threshold_s() == 18.0
    for step in range(13, 16):
        clock.now += 0.5
        found.stepped(step, step_time_s=0.5)
    assert found.hang_threshold_s() == 2.0
    compiling = Detector(heartbeat_timeout_s=1e9, hang_timeout_s=2.0, first_step_timeout_s=600.0, clock=clock)
    compiling.reset(2, step=0)
    assert compiling.hang_threshold_s() == 600.0


def test_ranks_outside_a_step_are_never_hung_and_survivors_get_time_to_unwind() -> None:
    clock = Clock()
    found = paced(clock, [3.0] + [0.5] * 10)
    for rank in (0, 1):
        found.heard(rank, waiting=None, where="saving a checkpoint")
    clock.now += 30.0  # a long checkpoint save between steps
    assert found.hung() is None
    assert found.unwind_s() == UNWIND_FLOOR_S  # an abort's survivors are not stuck after 2 s


def test_an_evaluation_longer_than_the_paced_threshold_is_no_hang() -> None:
    clock = Clock()
    found = paced(clock, [3.0] + [0.5] * 10)
    for rank in (0, 1):
        found.heard(rank, waiting=False, where="evaluation.py:40", evaluating=True)
    clock.now += 8.0  # eval.batches forward passes: 16 steps' time
    assert found.hung() is None
    clock.now += WARMUP_FLOOR_S
    assert found.hung() == [0, 1]  # a hung evaluation is still found


def test_a_running_jobs_hang_is_declared_from_its_pace_with_a_lowered_floor(make_controller, event_times):
    """The driver over the fake group, the floor lowered to 2 s (as the chaos soak does): 0.1 s
    steps reported one per poll, then rank 2 busy while the others wait on it. Declared ~2 s
    after the last step (the floor)."""
    controller = make_controller(
        *ELASTIC,
        "training.steps=10",
        "elastic.hang_timeout_s=2",
        script={
            "runs": {
                1: {"steps_done": 6, "held": "all", "paced": True, "waiting": {0: True, 1: True, 2: False, 3: True}}
            }
        },
    )
    assert finish(controller).status == "finished"
    steps = [time for name, time in event_times.times if name == "step"]
    [failure] = event_times.of("failure")
    # elastic.hang_timeout_s=2 (4 x 0.1 s is less), a poll, the abort's settling: within 5 s
    assert 2.0 < failure - steps[5] < 5.0
    assert [e["kind"] for e in events_of(Path(controller.events.path).parent, "failure")] == [LossKind.HANG]
