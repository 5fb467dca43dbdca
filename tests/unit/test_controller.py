"""The controller's state machine, stepped one iteration at a time with a fake worker group."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.config import load_config
from orchestrator.controller import Configuring, Controller, Finished, Running, Starting, group_errors
from orchestrator.events import EventLog, read_events
from orchestrator.worker_group import CallFailed
from tests.jobs import DEMO_CONFIG, REPO
from workers.actor import Heartbeat, RunOutcome


class FakeCalls:
    def __init__(self, results: dict[int, Any], after: int = 0) -> None:
        self.refs = list(results)
        self._pending = results
        self._after = after
        self.results: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.refs)

    def collect(self, timeout: float) -> dict[int, Any]:
        if self._after > 0:
            self._after -= 1
            return {}
        self.results = dict(self._pending)
        return self.results


class FakeGroup:
    """Ranks that 'train' instantly; the test decides what each run call returns."""

    script: dict[str, Any] = {}

    def __init__(self, *, spec, data, per_rank, start_timeout_s) -> None:
        self.spec = spec
        self.world = 0
        self.queued: dict[int, list[dict[str, Any]]] = {}
        self.stopped = False
        self.shut_down = False

    def start(self, mesh) -> None:
        self.world = mesh.world_size

    def configure(self, *, generation, mesh, start):
        return FakeCalls({rank: 0 for rank in range(self.world)}, after=self.script.get("configure_delay", 0))

    def run(self, *, last_step):
        steps = self.script.get("steps_done", last_step)
        for rank in range(self.world):
            self.queued[rank] = [
                {"kind": "step", "rank": rank, "step": s, "loss": 5.0 - s * 0.1 if rank == 0 else None,
                 "step_time_s": 0.1, "lr": 0.001, "grad_norm": 1.0}
                for s in range(1, steps + 1)
            ]
        outcomes = {rank: RunOutcome("finished", steps) for rank in range(self.world)}
        outcomes.update(self.script.get("outcomes", {}))
        return FakeCalls(outcomes)

    def poll(self, timeout):
        beats = {rank: Heartbeat(rank=rank, phase="step", step=0, phase_age_s=0.0, reports=self.queued.pop(rank, []))
                 for rank in range(self.world)}
        return beats

    def request_stop(self) -> None:
        self.stopped = True

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


def test_rank_failure_is_reported_grouped_and_ends_the_run(controller, tmp_path):
    FakeGroup.script = {"steps_done": 2, "outcomes": {1: RunOutcome("failed", 2, error="Traceback...\nValueError: boom")}}
    final = controller.run()
    assert final.status == "failed" and final.exit_code == 1
    events = read_events(tmp_path / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "rank_error" and failure["ranks"] == [1]
    assert failure["message"] == "[Rank 1]: ValueError: boom"


def test_dead_actor_is_a_rank_died_failure(controller, tmp_path):
    FakeGroup.script = {"outcomes": {0: CallFailed("died", "The actor died unexpectedly")}}
    assert controller.run().status == "failed"
    failure = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure")
    assert failure["kind"] == "rank_died"


def test_identical_errors_print_once():
    text = group_errors({0: "x\nRuntimeError: Connection closed by peer", 1: "RuntimeError: Connection closed by peer",
                         3: "ValueError: other"})
    assert text == "[Rank 0, 1]: RuntimeError: Connection closed by peer; [Rank 3]: ValueError: other"
