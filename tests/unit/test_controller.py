"""The controller's state machine, stepped one iteration at a time with a fake worker group."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.driver.controller import Configuring, Controller, Finished, Running, Starting, group_errors
from orchestrator.observe.events import EventLog, read_events
from orchestrator.driver.worker_group import CallFailed
from tests.jobs import DEMO_CONFIG, REPO
from workers.spec.messages import FailureKind, Heartbeat, RunOutcome


class FakeCalls:
    def __init__(self, results: dict[int, Any], after: int = 0) -> None:
        self.refs = list(results)
        self._pending = results
        self._after = after
        self.results: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.refs)

    def collect(self, timeout: float, *, first: bool = False) -> dict[int, Any]:
        if self._after > 0:
            self._after -= 1
            return {}
        self.results = dict(self._pending)
        return self.results


class FakeSlot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.node_id = None
        self.batch_id = index
        self.state = "active"


class FakeGroup:
    """Ranks that 'train' instantly; ``script`` decides what each generation's run returns."""

    script: dict[str, Any] = {}

    def __init__(self, *, spec, data, per_rank, start_timeout_s) -> None:
        self.spec = spec
        self.active: list[FakeSlot] = []
        self.queued: dict[int, list[dict[str, Any]]] = {}
        self.configured: list[dict[str, Any]] = []
        self.aborted: list[tuple[int, int]] = []
        self.killed: list[int] = []
        self.shut_down = False
        self.generation_runs = 0
        self.avoid_nodes = set()

    def start(self, mesh, spare_replicas=0) -> None:
        self.active = [FakeSlot(i) for i in range(mesh.world_size)]

    def start_replica_in_background(self, mesh) -> bool:
        return False

    def refresh(self):
        return []

    def warm(self):
        return []

    def starting(self):
        return []

    def kill(self, slots) -> None:
        self.killed += [slot.index for slot in slots]

    def remove(self, slots) -> None:
        self.active = [slot for slot in self.active if slot not in slots]

    def set_active(self, slots) -> None:
        self.active = list(slots)

    def abort_step(self, generation, step, survivors) -> None:
        self.aborted.append((generation, step))

    def request_pause(self, generation, *, checkpoint=False) -> None:
        pass

    def configure(self, *, generation, mesh, starts, sync_replicas, faults=()):
        self.configured.append({"mesh": mesh, "starts": starts, "sync": sync_replicas,
                                "slots": [slot.index for slot in self.active]})
        step = self.script.get("resume_step", 0) if generation > 1 else 0
        return FakeCalls({rank: step for rank in range(len(self.active))}, after=self.script.get("configure_delay", 0))

    def run(self, *, last_step):
        self.generation_runs += 1
        plan = self.script.get("runs", {}).get(self.generation_runs, {})
        first = (self.script.get("resume_step", 0) if self.generation_runs > 1 else 0) + 1
        steps = plan.get("steps_done", last_step)
        for rank in range(len(self.active)):
            self.queued[rank] = [
                {"kind": "step", "rank": rank, "step": s, "loss": 5.0 - s * 0.1 if rank == 0 else None,
                 "step_time_s": 0.1, "lr": 0.001, "grad_norm": 1.0, "time": 1000.0 + s}
                for s in range(first, steps + 1)
            ]
        outcomes = {rank: RunOutcome("finished", steps) for rank in range(len(self.active))}
        outcomes.update(plan.get("outcomes", {}))
        return FakeCalls(outcomes)

    def poll(self, timeout):
        return {rank: Heartbeat(rank=rank, phase="step", step=0, phase_age_s=0.0, reports=self.queued.pop(rank, []))
                for rank in range(len(self.active))}

    def request_stop(self) -> None:
        pass

    def shutdown(self, **_) -> None:
        self.shut_down = True


@pytest.fixture
def controller(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(Controller, "worker_group_class", FakeGroup)
    FakeGroup.script = {}
    config = load_config(DEMO_CONFIG, ["training.steps=4", "parallelism.pp=1", "parallelism.tp=1"])
    events = EventLog(tmp_path / "events.jsonl")
    return Controller(config, events, poll_interval_s=0.0)


def test_happy_path_state_by_state(controller, tmp_path):
    assert isinstance(controller.state, Starting)
    controller.step()
    assert isinstance(controller.state, Configuring) and controller.generation == 1
    controller.step()
    assert isinstance(controller.state, Running)
    controller.step()
    assert controller.state == Finished("finished", 0)
    final = controller.run()
    assert final.exit_code == 0 and controller.group.shut_down
    events = read_events(tmp_path / "events.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    assert steps[0]["world_size"] == 2 and steps[0]["tokens"] == 16 * 128
    assert steps[0]["loss"] == pytest.approx(4.9)
    assert events[-1]["event"] == "done" and events[-1]["status"] == "finished" and events[-1]["steps"] == 4


def test_configuration_waits_until_every_rank_answers(controller):
    FakeGroup.script = {"configure_delay": 3}
    controller.step()
    for _ in range(3):
        controller.step()
        assert isinstance(controller.state, Configuring)
    controller.step()
    assert isinstance(controller.state, Running)


def test_rank_failure_without_a_surviving_replica_ends_the_run(controller, tmp_path):
    FakeGroup.script = {"runs": {1: {"steps_done": 2, "outcomes": {
        0: RunOutcome("aborted", 2), 1: RunOutcome("failed", 2, error="Traceback...\nValueError: boom")}}}}
    final = controller.run()
    assert final.status == "failed" and final.exit_code == 1
    events = read_events(tmp_path / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "rank_error" and failure["ranks"] == [1]
    assert failure["message"] == "[Rank 1]: ValueError: boom"
    assert "no complete replica group survived" in final.reason


def test_dead_actor_is_a_rank_died_failure(controller, tmp_path):
    FakeGroup.script = {"runs": {1: {"outcomes": {0: CallFailed("died", "The actor died unexpectedly"),
                                                  1: RunOutcome("failed", 0, failure_kind=FailureKind.PEER_FAILURE)}}}}
    assert controller.run().status == "failed"
    failure = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure")
    assert failure["kind"] == "rank_died"


def test_lost_replica_shrinks_in_place_and_keeps_survivors(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(Controller, "worker_group_class", FakeGroup)
    FakeGroup.script = {"resume_step": 2, "runs": {1: {"steps_done": 2, "outcomes": {
        0: RunOutcome("aborted", 2), 1: RunOutcome("aborted", 2),
        2: CallFailed("died", "The actor died unexpectedly"), 3: RunOutcome("failed", 2, failure_kind=FailureKind.PEER_FAILURE)}}}}
    config = load_config(DEMO_CONFIG, ["training.steps=4", "parallelism.pp=1", "parallelism.tp=1",
                                       "parallelism.dp_replicate=2", "parallelism.dp_shard=2"])
    controller = Controller(config, EventLog(tmp_path / "events.jsonl"), poll_interval_s=0.0)
    final = controller.run()
    assert final.status == "finished"
    second = controller.group.configured[1]
    assert second["mesh"].dp_replicate == 1 and second["mesh"].world_size == 2
    assert second["slots"] == [0, 1]  # the surviving replica's processes, not restarted
    assert [start.mode for start in second["starts"]] == ["kept", "kept"] and not second["sync"]
    assert controller.group.aborted == [(1, 3)]
    events = read_events(tmp_path / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [2]
    recovered = next(e for e in events if e["event"] == "recovered")
    assert recovered["lost_steps"] == 0 and recovered["new_mesh"]["dp_replicate"] == 1
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3, 4]


def test_identical_errors_print_once():
    text = group_errors({0: "x\nRuntimeError: Connection closed by peer", 1: "RuntimeError: Connection closed by peer",
                         3: "ValueError: other"})
    assert text == "[Rank 0, 1]: RuntimeError: Connection closed by peer; [Rank 3]: ValueError: other"
