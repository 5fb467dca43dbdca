"""The controller's state machine, stepped one iteration at a time with a fake worker group."""

from __future__ import annotations

import time

import pytest

from elastic.spec import MeshSpec
from orchestrator.driver.calls import CallFailed, CallFailedKind
from orchestrator.driver.detector import UNWIND_FLOOR_S, Detector, DrainWatch, LossKind, Lost, group_errors
from orchestrator.driver.replicas import Replicas
from orchestrator.driver.states import Configuring, Finished, RunEnd, Running, SettlePurpose, Settling, Starting
from orchestrator.observe.events import read_events
from tests.unit.fake_group import ELASTIC, FakeCalls, FakeGroup, FakeSlot, fake_group
from workers.faults import DriverFaults, FaultKind, FaultPhase, FaultSpec, InjectedFault
from workers.spec.messages import (
    DrainNoticeReport,
    FailureKind,
    Heartbeat,
    LogReport,
    NoticeScope,
    Phase,
    RunOutcome,
    RunStatus,
    failure_kind_of,
)


def test_happy_path_state_by_state(controller, tmp_path):
    assert isinstance(controller.state, Starting)
    controller.step()
    assert isinstance(controller.state, Configuring) and controller.generation == 1
    controller.step()
    assert isinstance(controller.state, Running)
    controller.step()
    assert controller.state == Finished(RunEnd.FINISHED, 0)
    final = controller.run()
    assert final.exit_code == 0 and fake_group(controller).shut_down
    events = read_events(tmp_path / "events.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert steps[0]["world_size"] == 2 and steps[0]["tokens"] == 16 * 128
    assert steps[0]["loss"] == pytest.approx(4.9)
    assert events[-1]["event"] == "done" and events[-1]["status"] == "finished" and events[-1]["steps"] == 4


def test_the_last_steps_reports_in_a_slow_poll_are_taken_before_the_run_ends(controller, tmp_path):
    # The ranks' polls answer only after their run calls returned and the drain after them gave
    # up (seen on a loaded CI machine: a 2-step run ended with exit 0 and no step events).
    FakeGroup.script = {"unanswered_polls": 3}
    final = controller.run()
    assert final.exit_code == 0
    events = read_events(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]
    assert events[-1]["event"] == "done" and events[-1]["steps"] == 4


def test_configuration_waits_until_every_rank_answers(controller):
    FakeGroup.script = {"configure_delay": 3}
    controller.step()
    for _ in range(3):
        controller.step()
        assert isinstance(controller.state, Configuring)
    controller.step()
    assert isinstance(controller.state, Running)


def test_reports_are_taken_while_the_ranks_configure(controller, tmp_path):
    """A rank's reports (the last generation's checkpoint uploads, its logs) reach the driver
    while the mesh configures, not only once it runs: a rank that dies configuring would take
    them along."""
    FakeGroup.script = {"configure_delay": 3}
    controller.step()
    fake_group(controller).queued[1] = [LogReport(rank=1, time=1.0, level="warning", logger="meshpilot", message="hi")]
    controller.step()
    assert isinstance(controller.state, Configuring)
    [log_event] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "log"]
    assert (log_event["rank"], log_event["message"]) == (1, "hi")


def test_rank_failure_without_a_surviving_replica_ends_the_run(controller, tmp_path):
    FakeGroup.script = {
        "runs": {
            1: {
                "steps_done": 2,
                "outcomes": {
                    0: RunOutcome(RunStatus.ABORTED, 2),
                    1: RunOutcome(RunStatus.FAILED, 2, error="Traceback...\nValueError: boom"),
                },
            }
        }
    }
    final = controller.run()
    assert final.status == "failed" and final.exit_code == 1
    events = read_events(tmp_path / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "rank_error" and failure["ranks"] == [1]
    assert failure["message"] == "[Rank 1]: ValueError: boom"
    assert "no complete replica group survived" in final.reason


def test_dead_actor_is_a_rank_died_failure(controller, tmp_path):
    FakeGroup.script = {
        "runs": {
            1: {
                "outcomes": {
                    0: CallFailed(CallFailedKind.DIED, "The actor died unexpectedly"),
                    1: RunOutcome(RunStatus.FAILED, 0, failure_kind=FailureKind.PEER_FAILURE),
                }
            }
        }
    }
    assert controller.run().status == "failed"
    failure = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure")
    assert failure["kind"] == "rank_died"


def test_lost_replica_shrinks_in_place_and_keeps_survivors(make_controller, tmp_path):
    controller = make_controller(
        *ELASTIC,
        committed_steps=[],
        script={
            "runs": {
                1: {
                    "steps_done": 2,
                    "outcomes": {
                        0: RunOutcome(RunStatus.ABORTED, 2),
                        1: RunOutcome(RunStatus.ABORTED, 2),
                        2: CallFailed(CallFailedKind.DIED, "The actor died unexpectedly"),
                        3: RunOutcome(RunStatus.FAILED, 2, failure_kind=FailureKind.PEER_FAILURE),
                    },
                }
            }
        },
    )
    checkpoints = controller.checkpoints
    final = controller.run()
    assert final.status == "finished"
    # The old mesh's saves up to step 2 still commit without rank 2: replica 0 survived whole.
    assert checkpoints.resets == [(4, None, frozenset()), (2, 2, frozenset({2}))]
    second = fake_group(controller).configured[1]
    assert second["mesh"].dp_replicate == 1 and second["mesh"].world_size == 2
    assert second["slots"] == [0, 1]  # the surviving replica's processes, not restarted
    assert [start.mode for start in second["starts"]] == ["kept", "kept"] and not second["sync"]
    assert fake_group(controller).aborted == [(1, 3)]
    events = read_events(tmp_path / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [2]
    recovered = next(e for e in events if e["event"] == "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]


def test_identical_errors_print_once():
    text = group_errors(
        {
            0: "x\nRuntimeError: Connection closed by peer",
            1: "RuntimeError: Connection closed by peer",
            3: "ValueError: other",
        }
    )
    assert text == "[Rank 0, 1]: RuntimeError: Connection closed by peer; [Rank 3]: ValueError: other"


def test_a_corrupt_checkpoint_during_a_restore_falls_back_to_the_previous_one(make_controller, tmp_path):
    controller = make_controller(committed_steps=[2, 3])
    FakeGroup.script = {"corrupt": {3}}
    final = controller.run()
    assert final.status == "finished"
    restores = [[start.step for start in configured["starts"]] for configured in fake_group(controller).configured]
    assert restores == [[3, 3], [2, 2]]
    events = read_events(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "restored"] == [2]
    assert [e["step"] for e in events if e["event"] == "step"] == [3, 4]


def test_a_corrupt_checkpoint_with_nothing_older_ends_the_run(make_controller):
    controller = make_controller(committed_steps=[3])
    FakeGroup.script = {"corrupt": {3}}
    final = controller.run()
    assert final.status == "failed" and "no intact checkpoint left to restore" in final.reason


def test_only_the_failure_kind_marks_a_checkpoint_corrupt_not_the_message(make_controller):
    controller = make_controller(committed_steps=[2, 3])
    FakeGroup.script = {"corrupt": {3}, "corrupt_kind": FailureKind.OWN_ERROR}
    final = controller.run()
    assert final.status == "failed" and len(fake_group(controller).configured) == 1
    assert final.reason == "[Rank 0]: CorruptCheckpointError: step 3: checksum mismatch"


# ------------------------------------------------------------------ the controller's helpers, without Ray
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def detector(clock: Clock, *, nodes: dict[int, str] | None = None, dead: set[str] | None = None) -> Detector:
    return Detector(
        heartbeat_timeout_s=10.0,
        hang_timeout_s=60.0,
        node_of=(nodes or {}).get,
        dead_nodes=lambda: set(dead or ()),
        clock=clock,
    )


def test_a_dead_actor_on_a_dead_node_is_a_lost_node_and_peer_echoes_are_no_loss() -> None:
    found = detector(Clock(), nodes={0: "n0", 1: "n1", 2: "n1"}, dead={"n0"}).losses(
        {
            0: CallFailed(CallFailedKind.DIED, "The actor died unexpectedly"),
            1: CallFailed(CallFailedKind.DIED, "The actor died unexpectedly"),
            2: RunOutcome(
                RunStatus.FAILED,
                3,
                error="RuntimeError: Connection closed by peer",
                failure_kind=FailureKind.PEER_FAILURE,
            ),
        },
        hangs=False,
    )
    assert found == {
        0: Lost(LossKind.NODE_LOST, "node n0 left the cluster", "n0"),
        1: Lost(LossKind.RANK_DIED, "The actor died unexpectedly", "n1"),
    }


def test_a_returned_loss_outranks_silence_and_silence_needs_a_timeout() -> None:
    clock = Clock()
    watch = detector(clock)
    watch.reset(world_size=3)
    clock.now += 11.0
    watch.heard(2, waiting=None, where=None)
    found = watch.losses({0: RunOutcome(RunStatus.FAILED, 1, error="ValueError: boom")}, hangs=False)
    assert {rank: loss.kind for rank, loss in found.items()} == {0: LossKind.RANK_ERROR, 1: LossKind.UNRESPONSIVE}


def test_ranks_silent_while_their_generation_fails_are_lost_with_their_node_or_after_the_heartbeat_timeout() -> None:
    """A silent rank on a node Ray reports gone is lost after the short grace; one on a live node
    (a busy machine answers late) only after elastic.heartbeat_timeout_s, as while running."""
    clock = Clock()
    watch = detector(clock, nodes={0: "n0", 1: "n1"}, dead={"n1"})
    watch.reset(world_size=2)
    since = clock.now
    assert watch.silent_while_failing([0, 1], since=since) == {}
    clock.now += 4.0
    found = watch.silent_while_failing([0, 1], since=since)
    assert {rank: loss.kind for rank, loss in found.items()} == {1: LossKind.NODE_LOST}
    assert watch.losses({}, hangs=False) == {}  # rank 0: 4 s of silence, under the 10 s timeout
    clock.now += 7.0
    assert watch.losses({}, hangs=False)[0].kind == LossKind.UNRESPONSIVE


def test_settling_notes_the_first_time_every_call_has_returned() -> None:
    mesh = MeshSpec(dp_replicate=1, dp_shard=2, tp=1, pp=1)
    calls = FakeCalls({0: RunOutcome(RunStatus.ABORTED, 1)})
    state = Settling(generation=1, mesh=mesh, calls=calls, purpose=SettlePurpose.FAILURE)
    assert state.noting_returns(5.0).all_returned_at is None
    calls.collect(0.0)
    noted = state.noting_returns(5.0)
    assert noted.all_returned_at == 5.0 and noted.noting_returns(9.0).all_returned_at == 5.0


def test_a_lost_replica_leaves_whole_and_its_healthy_ranks_go_to_the_pool(controller):
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)
    group, replicas = fake_group(controller), controller.replicas
    group.start(mesh)
    assert replicas.healthy_in_hit_replicas(mesh, lost={2}, draining=()) == 1
    kept, pool = replicas.split(mesh, lost={2}, draining=(), drop=(1,))
    assert [slot.index for slot in kept] == [0, 1] and [slot.index for slot in pool] == [3]
    assert [slot.index for slot in group.active] == [0, 1, 3]  # the lost rank's actor is removed
    assert Replicas.pick_warm(pool, 2) == [] and Replicas.pick_warm(pool, 1) == pool


def test_warm_actors_are_picked_by_group_then_in_the_order_they_started_not_by_address() -> None:
    # Which survivor gets which rank must not depend on where Python allocated its slot, or a
    # chaos seed's second fault hits a different actor from one replay to the next.
    started = [FakeSlot(index) for index in range(6)]
    for slot in started:
        slot.batch_id = 7 if slot.index < 3 else 2
    by_address = sorted(started, key=id, reverse=True)
    pool = [slot for slot in started if slot.batch_id == 7] + [slot for slot in by_address if slot.batch_id == 2]
    assert Replicas.pick_warm(pool, 5) == pool[3:] + pool[:2]


def test_driver_faults_fire_once_when_their_step_completed_and_a_failure_consumes_its_step() -> None:
    killed: list[bool] = []
    removed: list[str] = []
    faults = DriverFaults(
        [FaultSpec.parse("driver@3"), FaultSpec.parse("node@2:1"), FaultSpec.parse("kill@5:1")],
        node_of={1: "n1"}.get,
        remove_node=removed.append,
    )
    assert faults.for_generation(after_step=2) == (FaultSpec(FaultKind.DRIVER, 3), FaultSpec(FaultKind.KILL, 5, 1))
    faults.fire(2, kill_driver=lambda: killed.append(True))
    faults.fire(2, kill_driver=lambda: killed.append(True))
    assert removed == ["n1"] and not killed
    faults.fire(3, kill_driver=lambda: killed.append(True))
    assert killed == [True]
    faults.consume_after_failure(last_completed_step=4)
    assert faults.pending == []


def test_an_injected_raise_declares_its_failure_kind() -> None:
    assert failure_kind_of(InjectedFault("injected fault raise@2:0")) == FailureKind.INJECTED
    assert FaultSpec.parse("s3_outage@4:1").kind is FaultKind.S3_OUTAGE


def test_sigterm_to_one_process_retires_that_actor_and_a_cloud_notice_drains_its_node(controller):
    """Regression: SIGTERM to one rank process was taken as a drain of its whole node; on a
    single-node cluster that drained every replica group and waited for capacity that never came."""
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)
    group = fake_group(controller)
    group.start(mesh)
    for slot in group.active:
        slot.node_id = "the-only-node"
    controller.drains.ray_draining = set  # Ray marks nothing draining
    controller._on_drain_notice(DrainNoticeReport(rank=2, time=0.0, reason="SIGTERM", scope=NoticeScope.PROCESS))
    draining = controller.replicas.leaving(controller.drains.nodes(), controller.drains.retiring)
    assert draining == {2} and not group.avoid_nodes
    kept, pool = controller.replicas.split(mesh, lost=(), draining=draining, drop=(1,))
    assert [slot.index for slot in kept] == [0, 1] and [slot.index for slot in pool] == [3]
    assert 2 not in [slot.index for slot in group.active]  # the signalled actor is retired, not reused

    controller._on_drain_notice(DrainNoticeReport(rank=0, time=0.0, reason="instance action: terminate"))
    assert group.avoid_nodes == {"the-only-node"}
    assert controller.replicas.leaving(controller.drains.nodes()) == {0, 1, 2}  # the node's every rank


def test_a_drain_of_every_node_that_can_hold_a_rank_has_nowhere_to_go() -> None:
    drains = DrainWatch(lambda: {"a"}, lambda: {"a", "b"})
    assert drains.nowhere_to_go(avoided=set()) is None  # b can take the ranks: restore there
    assert drains.nowhere_to_go(avoided={"b"}) == {"a", "b"}  # b announced its own end earlier
    assert DrainWatch(lambda: {"a"}, lambda: {"a"}).nowhere_to_go(avoided=set()) == {"a"}  # the only node


def test_a_hang_while_a_grow_is_pending_is_found_by_the_hang_threshold_not_a_fixed_timeout(controller):
    """Regression: a rank hung while the ranks finished their last step before a grow was found
    only by a fixed 30 s settle timeout, and then as 'stuck' instead of hung."""
    mesh = MeshSpec(dp_replicate=2, dp_shard=2, tp=1, pp=1)
    group = fake_group(controller)
    group.start(mesh)
    controller.detector.reset(mesh.world_size, step=4)
    controller.detector.stepped(5, step_time_s=0.1)  # past the generation's warm-up step
    group.poll = lambda timeout: {
        rank: Heartbeat(rank=rank, phase=Phase.STEP, step=5, phase_age_s=1.0, waiting=rank != 2, where="x.py:1")
        for rank in range(4)
    }
    running = Running(generation=1, mesh=mesh, calls=FakeCalls({r: None for r in range(4)}, after=10**6))
    settling = controller.mesh_change.begin_settling(running, SettlePurpose.GROW)
    assert settling.deadline == float("inf")  # a pause waits for the step in flight, however long
    assert controller.mesh_change.settle(settling).purpose == SettlePurpose.GROW  # within the hang threshold: no loss
    threshold = controller.detector.hang_threshold_s()
    assert threshold == controller.config.elastic.hang_timeout_s
    controller.detector.progress = (5, controller.detector.progress[1] - threshold - 0.1)
    failing = controller.mesh_change.settle(settling)
    assert isinstance(failing, Settling) and failing.purpose == SettlePurpose.FAILURE
    assert {rank: loss.kind for rank, loss in failing.lost.items()} == {2: LossKind.HANG}
    assert group.killed == [2] and group.aborted == [(1, 1)]
    assert failing.deadline <= time.monotonic() + UNWIND_FLOOR_S  # survivors unwind within the threshold's floor


def test_a_rank_lost_while_a_recovery_configures_restarts_the_recovery_from_what_is_left(make_controller, tmp_path):
    """Regression: a fault during a recovery's configuration failed the run. Replica 3 of 4 loses
    its rank and the job shrinks to 2 (3 cannot split the batch); while those configure, rank 1
    dies too: the recovery starts again from replica 0, its state kept, refilled by the warm actor of
    replica 2."""
    died = CallFailed(CallFailedKind.DIED, "The actor died unexpectedly")
    echo = CallFailed(CallFailedKind.ERROR, "PeerFailedWhileConfiguring: ...", failure_kind=FailureKind.PEER_FAILURE)
    script = {
        "runs": {
            1: {"steps_done": 2, "outcomes": {3: died, **{r: RunOutcome(RunStatus.ABORTED, 2) for r in (0, 1, 2)}}}
        },
        "configure_failures": {2: {1: died, 0: echo}},
    }
    controller = make_controller("parallelism.dp_replicate=4", "parallelism.dp_shard=1", script=script)
    final = controller.run()
    assert final.status == "finished", final.reason
    configured = fake_group(controller).configured
    # Replica 2 (dropped for the batch's sake) waits warm: it refills replica 1's place from replica 0.
    assert [c["mesh"].dp_replicate for c in configured] == [4, 2, 2]
    assert configured[2]["slots"] == [0, 2] and [s.mode for s in configured[2]["starts"]] == ["kept", "peer"]
    events = read_events(tmp_path / "events.jsonl")
    assert [e["ranks"] for e in events if e["event"] == "failure"] == [[3], [1]]  # the echo is no loss
    assert controller.failure_policy.failure_times and len(controller.failure_policy.failure_times) == 1
    assert controller.failure_policy.attempts == 2  # one incident, recovered at the second attempt
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]


def test_configure_faults_parse_and_stay_armed_for_the_recovery_that_follows_a_step_fault() -> None:
    fault = FaultSpec.parse("kill@10:1/configure")
    assert fault == FaultSpec(FaultKind.KILL, 10, 1, FaultPhase.CONFIGURE) and fault.describe() == "kill@10:1/configure"
    assert FaultSpec.parse("kill@4:2/snapshot") == FaultSpec(FaultKind.KILL, 4, 2, FaultPhase.SNAPSHOT)
    joining = FaultSpec.parse("kill@10:3/join")
    assert joining == FaultSpec(FaultKind.KILL, 10, 3, FaultPhase.JOIN) and joining.describe() == "kill@10:3/join"
    for bad in ("hang@10:1/configure", "kill@10:1/upload", "raise@10:1/snapshot", "raise@10:1/join"):
        with pytest.raises(ValueError, match=r"the phases are /configure \(for kill and raise"):
            FaultSpec.parse(bad)
    faults = DriverFaults([FaultSpec.parse("kill@10:3"), fault, joining, FaultSpec.parse("raise@12:0")])
    faults.consume_after_failure(9)  # the step fault at 10 fired: the recovery configures for step 10
    assert [f.describe() for f in faults.for_generation(9)] == ["kill@10:1/configure", "kill@10:3/join", "raise@12:0"]
    faults.consume_after_failure(9, configuring=True)  # and that configuration failed: spent
    assert [f.describe() for f in faults.pending] == ["raise@12:0"]


def test_a_compiling_jobs_first_step_of_each_mesh_may_take_the_compile_timeout_then_the_hang_threshold_holds() -> None:
    clock = Clock()
    found = Detector(heartbeat_timeout_s=10.0, hang_timeout_s=60.0, first_step_timeout_s=600.0, clock=clock)
    found.reset(2, step=3)  # a new mesh resumes after step 3: step 4 may compile
    for rank in (0, 1):
        found.heard(rank, waiting=False, where="compiling")
    clock.now += 599
    assert found.hung() is None
    clock.now += 2
    assert found.hung() == [0, 1]
    found.stepped(4, step_time_s=0.1)  # compiled: from step 5 on, the plain threshold
    clock.now += 61
    assert found.hung() == [0, 1]
