"""The controller's state machine, stepped one iteration at a time with a fake worker group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any

import pytest

from elastic.placement import RankResources
from elastic.spec import MeshSpec
from orchestrator.config import load_config
from orchestrator.driver.calls import CallFailed, CallFailedKind
from orchestrator.driver.controller import Controller
from orchestrator.driver.detector import group_errors
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from orchestrator.driver.states import Configuring, Finished, RunEnd, Running, Starting
from orchestrator.driver.worker_group import SlotState
from orchestrator.observe.events import EventLog, read_events
from tests.jobs import DEMO_CONFIG, REPO
from workers.faults import FaultSpec
from workers.spec import TrainSpec
from workers.spec.messages import FailureKind, Heartbeat, Phase, RunOutcome, RunStatus, StartFrom, StartMode


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
        self.node_id: str | None = None
        self.batch_id = index
        self.state = SlotState.ACTIVE


class FakeGroup:
    """Ranks that 'train' instantly; ``script`` decides what each generation's run returns."""

    script: dict[str, Any] = {}

    def __init__(self, *, spec: TrainSpec, data: bytes | None, per_rank: RankResources,
                 start_timeout_s: float) -> None:
        self.spec = spec
        self.active: list[FakeSlot] = []
        self.queued: dict[int, list[dict[str, Any]]] = {}
        self.configured: list[dict[str, Any]] = []
        self.aborted: list[tuple[int, int]] = []
        self.killed: list[int] = []
        self.shut_down = False
        self.generation_runs = 0
        self.avoid_nodes: set[str] = set()

    def start(self, mesh: MeshSpec, *, spare_replicas: int = 0) -> None:
        self.active = [FakeSlot(i) for i in range(mesh.world_size)]

    def start_replica_in_background(self, mesh: MeshSpec) -> bool:
        return False

    def refresh(self) -> list[FakeSlot]:
        return []

    def warm(self) -> list[FakeSlot]:
        return []

    def starting(self) -> list[FakeSlot]:
        return []

    def kill(self, slots: list[FakeSlot]) -> None:
        self.killed += [slot.index for slot in slots]

    def remove(self, slots: list[FakeSlot]) -> None:
        self.active = [slot for slot in self.active if slot not in slots]

    def set_active(self, slots: list[FakeSlot]) -> None:
        self.active = list(slots)

    def abort_step(self, generation: int, step: int, survivors: list[int]) -> None:
        self.aborted.append((generation, step))

    def request_pause(self, generation: int, *, checkpoint: bool = False) -> None:
        pass

    def configure(self, *, generation: int, mesh: MeshSpec, starts: list[StartFrom], sync_replicas: bool,
                  faults: tuple[FaultSpec, ...] = ()) -> FakeCalls:
        self.configured.append({"mesh": mesh, "starts": starts, "sync": sync_replicas,
                                "slots": [slot.index for slot in self.active]})
        step = self.script.get("resume_step", 0) if generation > 1 else 0
        results: dict[int, Any] = {rank: start.step if start.mode == StartMode.CHECKPOINT else step
                                   for rank, start in enumerate(starts)}
        if starts and starts[0].mode == StartMode.CHECKPOINT and starts[0].step in self.script.get("corrupt", ()):
            results[0] = CallFailed(CallFailedKind.ERROR, f"CorruptCheckpointError: step {starts[0].step}: checksum "
                                    "mismatch", failure_kind=self.script.get("corrupt_kind",
                                                                             FailureKind.CORRUPT_CHECKPOINT))
        return FakeCalls(results, after=self.script.get("configure_delay", 0))

    def run(self, *, last_step: int) -> FakeCalls:
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
        outcomes: dict[int, Any] = {rank: RunOutcome(RunStatus.FINISHED, steps) for rank in range(len(self.active))}
        outcomes.update(plan.get("outcomes", {}))
        return FakeCalls(outcomes)

    def poll(self, timeout: float) -> dict[int, Heartbeat | CallFailed]:
        return {rank: Heartbeat(rank=rank, phase=Phase.STEP, step=0, phase_age_s=0.0,
                                reports=tuple(self.queued.pop(rank, [])))
                for rank in range(len(self.active))}

    def request_stop(self) -> None:
        pass

    def shutdown(self, *, grace_s: float = 5.0) -> None:
        self.shut_down = True


# The type checker holds the fake to the protocol the controller is written against.
FAKE_GROUP_CLASS: type[WorkerGroupProtocol[Any]] = FakeGroup
FAKE_SLOT: type[Slot] = FakeSlot


@pytest.fixture
def controller(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(Controller, "worker_group_class", FAKE_GROUP_CLASS)
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
    assert controller.state == Finished(RunEnd.FINISHED, 0)
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
        0: RunOutcome(RunStatus.ABORTED, 2), 1: RunOutcome(RunStatus.FAILED, 2, error="Traceback...\nValueError: boom")}}}}
    final = controller.run()
    assert final.status == "failed" and final.exit_code == 1
    events = read_events(tmp_path / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "rank_error" and failure["ranks"] == [1]
    assert failure["message"] == "[Rank 1]: ValueError: boom"
    assert "no complete replica group survived" in final.reason


def test_dead_actor_is_a_rank_died_failure(controller, tmp_path):
    FakeGroup.script = {"runs": {1: {"outcomes": {
        0: CallFailed(CallFailedKind.DIED, "The actor died unexpectedly"),
        1: RunOutcome(RunStatus.FAILED, 0, failure_kind=FailureKind.PEER_FAILURE)}}}}
    assert controller.run().status == "failed"
    failure = next(e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "failure")
    assert failure["kind"] == "rank_died"


def test_lost_replica_shrinks_in_place_and_keeps_survivors(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(Controller, "worker_group_class", FAKE_GROUP_CLASS)
    FakeGroup.script = {"resume_step": 2, "runs": {1: {"steps_done": 2, "outcomes": {
        0: RunOutcome(RunStatus.ABORTED, 2), 1: RunOutcome(RunStatus.ABORTED, 2),
        2: CallFailed(CallFailedKind.DIED, "The actor died unexpectedly"),
        3: RunOutcome(RunStatus.FAILED, 2, failure_kind=FailureKind.PEER_FAILURE)}}}}
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


@dataclass(frozen=True)
class FakeManifest:
    step: int
    mesh: dict[str, Any]


class FakeCheckpoints:
    """Committed checkpoints at ``steps``: what the controller asks of checkpoint commits."""

    enabled = True
    uri = "file:///fake"

    def __init__(self, steps: list[int], mesh: MeshSpec) -> None:
        self.manifests = [FakeManifest(step, mesh.as_dict()) for step in sorted(steps)]

    def check_access(self) -> None:
        pass

    def reset(self, mesh: MeshSpec) -> None:
        pass

    def latest_step(self) -> int | None:
        return self.manifests[-1].step if self.manifests else None

    def choose_resume(self, skip_steps: AbstractSet[int] = frozenset()) -> FakeManifest | None:
        intact = [manifest for manifest in self.manifests if manifest.step not in skip_steps]
        return intact[-1] if intact else None


def test_a_corrupt_checkpoint_during_a_restore_falls_back_to_the_previous_one(controller, monkeypatch, tmp_path):
    monkeypatch.setattr(controller, "checkpoints", FakeCheckpoints([2, 3], controller.config.mesh))
    FakeGroup.script = {"corrupt": {3}}
    final = controller.run()
    assert final.status == "finished"
    restores = [[start.step for start in configured["starts"]] for configured in controller.group.configured]
    assert restores == [[3, 3], [2, 2]]
    events = read_events(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "restored"] == [2]
    assert [e["step"] for e in events if e["event"] == "step"] == [3, 4]


def test_a_corrupt_checkpoint_with_nothing_older_ends_the_run(controller, monkeypatch):
    monkeypatch.setattr(controller, "checkpoints", FakeCheckpoints([3], controller.config.mesh))
    FakeGroup.script = {"corrupt": {3}}
    final = controller.run()
    assert final.status == "failed" and "no intact checkpoint left to restore" in final.reason


def test_only_the_failure_kind_marks_a_checkpoint_corrupt_not_the_message(controller, monkeypatch):
    monkeypatch.setattr(controller, "checkpoints", FakeCheckpoints([2, 3], controller.config.mesh))
    FakeGroup.script = {"corrupt": {3}, "corrupt_kind": FailureKind.OWN_ERROR}
    final = controller.run()
    assert final.status == "failed" and len(controller.group.configured) == 1
    assert final.reason == "[Rank 0]: CorruptCheckpointError: step 3: checksum mismatch"
