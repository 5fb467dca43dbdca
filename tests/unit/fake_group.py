"""A scriptable fake worker group, fake cluster, fake checkpoints and a fake clock: the controller's
state machine stepped in milliseconds, without Ray.

The controller is built as usual with ``Controller.worker_group_class = FakeGroup``. What the
ranks do is a script (``FakeGroup.script``, set before the controller is built), per generation's
``run`` call (``runs[n]``: the n-th run call) and per ``configure`` call:

    runs: {n: {
        "steps_done": S,          # every rank applies and reports steps up to S (default: the last)
        "outcomes": {rank: r},    # run calls that return at once (RunOutcome or CallFailed)
        "held": "all" | {ranks},  # run calls in flight until the driver ends them: an abort returns
                                  # ABORTED, a pause PAUSED, a stop STOPPED, a kill or a lost node DIED
        "stuck": {ranks},         # held, and out of reach of aborts and pauses: only a kill ends them
        "waiting": {rank: bool},  # the heartbeat's ``waiting`` (hang blame: busy ranks are the culprits)
        "slow": {rank: factor},   # the rank's compute phase takes factor x its peers' (a straggler)
        "paced": True,            # one step per poll (else every step at the first): a pause then
                                  # ends the run after the step in flight
        "reports": {rank: [...]}, # reports queued after the step reports (drain notices, evals)
        "draining": {nodes},      # nodes Ray marks draining when the run starts
        "uncopied": {(step, rank)},  # snapshots whose copy to the buddy never completed
        "commits": [steps],       # checkpoints of these steps commit (to ``saves_to``) as the run goes
    }}
    configure_failures: {generation: {rank: CallFailed}}
    configure_held: {generation: {ranks}}  # configure calls that never return (torch's rendezvous)
    configure_delay: polls before the configure calls answer
    corrupt: checkpoint steps whose restore fails (``corrupt_kind``, default CORRUPT_CHECKPOINT)
    snapshots: True for ranks that take peer-memory snapshots (the layout at configure, one per
               snapshot step) and report the bytes they restore from peers
    nodes: the node of each slot ``start`` makes, in order (spares too); ``replicas_on(...)`` builds it
    digests: {rank: state digest} of finished runs (default: all equal)
    start_error: what ``start`` raises (a cluster that cannot place the mesh)
    saves_to: the ``FakeCheckpoints`` a pause that asks for a checkpoint commits to
    unanswered_polls: polls nobody answers (a loaded machine)

A network fault (``partition@STEP:NODE``) cuts node ``n{NODE}`` off (``FakeCluster.apply``): its
ranks answer no poll, their run calls stay in flight (aborts and pauses do not reach them) until
the driver kills them, and the node accepts no connection (``unreachable_nodes``).

``FakeCluster`` stands in for what Ray says of the cluster (dead, draining nodes, hosts, room to
start a replica group in the background: ``capacity``, one node per group). ``FakeTime`` stands in
for the driver modules' ``time``: every poll of the ranks takes ``POLL_S`` of it, so timeouts
(hang threshold, settle deadlines, Ray's grace to name a cause) pass in a few hundred polls.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import pytest

from checkpointing.spec import ChunkEntry, TensorEntry
from elastic.placement import RankResources
from elastic.spec import MeshSpec
from orchestrator.config import load_config
from orchestrator.driver import cluster, mesh_change, polling, restore, transitions
from orchestrator.driver import controller as controller_module
from orchestrator.driver.calls import CallFailed, CallFailedKind
from orchestrator.driver.controller import Controller
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from orchestrator.driver.states import Finished
from orchestrator.driver.worker_group import SlotState
from orchestrator.observe.events import EventLog, read_events
from tests.jobs import DEMO_CONFIG, REPO
from workers.faults import FaultSpec, NetworkFault, NetworkFaultKind
from workers.spec import TrainSpec
from workers.spec.messages import (
    EvalReport,
    FailureKind,
    Heartbeat,
    MemoryRestoreReport,
    Phase,
    RankReport,
    RunOutcome,
    RunStatus,
    SnapshotLayoutReport,
    SnapshotPlan,
    SnapshotReport,
    StartFrom,
    StartMode,
    StepReport,
)

# Driver time one poll of the ranks takes.
POLL_S = 0.5
DIED = CallFailed(CallFailedKind.DIED, "The actor died unexpectedly")


class FakeTime:
    """The ``time`` module as the driver modules see it: ``monotonic`` moves only when the ranks
    are polled (``advance``) or the driver sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.wall_offset = time.time() - self.now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall_offset + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeCalls:
    """One method on many ranks. ``results`` fill in at ``collect``, after ``after`` collects;
    ``held`` ranks answer only once ``release``d."""

    def __init__(self, results: dict[int, Any], after: int = 0, held: Iterable[int] = ()) -> None:
        self.refs = list(results)
        self._pending = dict(results)
        self._after = after
        self.held = set(held)
        self.results: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.refs)

    def collect(self, timeout: float, *, first: bool = False) -> dict[int, Any]:
        if self._after > 0:
            self._after -= 1
            return {}
        arrived = {
            rank: result for rank, result in self._pending.items() if rank not in self.held and rank not in self.results
        }
        self.results.update(arrived)
        return arrived

    def release(self, rank: int, result: Any) -> None:
        """Rank ``rank``'s call returns ``result`` at the next collect (once; later ones are ignored)."""
        if rank in self.held:
            self.held.discard(rank)
            self._pending[rank] = result


class FakeSlot:
    """One actor of the fake group; ``index``: the order it was made in."""

    def __init__(self, index: int, *, batch_id: int | None = None, node_id: str | None = None) -> None:
        self.index = index
        self.node_id = node_id
        self.batch_id = index if batch_id is None else batch_id
        self.state = SlotState.ACTIVE
        self.actor = f"actor-{index}"

    def __repr__(self) -> str:
        return f"FakeSlot({self.index}, {self.state}, node={self.node_id})"


class FakeCluster:
    """What Ray says of the cluster: dead and draining nodes, the hosts that could hold a rank, and
    ``capacity`` (a node per replica group that can start in the background, first come first used)."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.draining: set[str] = set()
        self.hosts: set[str] = set()
        self.capacity: list[str | None] = []
        self.group: FakeGroup | None = None
        self.unreachable: set[str] = set()
        self.network_faults: list[NetworkFault] = []

    def draining_nodes(self) -> set[str]:
        return set(self.draining)

    def hosts_for(self, per_rank: RankResources) -> set[str]:
        return set(self.hosts)

    def dead_nodes(self, node_ids: set[str]) -> set[str]:
        return node_ids & self.dead

    def unreachable_nodes(self, node_ids: set[str]) -> set[str]:
        return node_ids & (self.unreachable | self.dead)

    def apply(self, fault: NetworkFault) -> None:
        """The driver's network fault: a partition cuts node ``n{fault.node}`` off (never healed here)."""
        self.network_faults.append(fault)
        if fault.kind == NetworkFaultKind.PARTITION:
            self.unreachable.add(f"n{fault.node}")

    def remove_node(self, node: str) -> None:
        """A node leaves the cluster (the driver's ``node`` fault): its actors die with it."""
        self.dead.add(node)
        self.hosts.discard(node)
        if self.group is not None:
            self.group.node_died(node)


@dataclass
class _Run:
    """The run call in flight: its calls, the slots that hold its ranks, and its plan."""

    calls: FakeCalls
    slots: list[FakeSlot]
    steps_done: int
    plan: dict[str, Any]
    delivered: int = 0  # with ``paced``: the last step whose reports a poll handed over


class FakeGroup:
    """Ranks that 'train' instantly; ``script`` decides what each generation does (module docstring)."""

    script: dict[str, Any] = {}
    cluster: FakeCluster = FakeCluster()

    def __init__(self, *, spec: TrainSpec, data: bytes | None, per_rank: RankResources, start_timeout_s: float) -> None:
        self.spec = spec
        self.slots: list[FakeSlot] = []
        self.active: list[FakeSlot] = []
        self.queued: dict[int, list[RankReport]] = {}
        self.configured: list[dict[str, Any]] = []
        self.aborted: list[tuple[int, int]] = []
        self.pauses: list[tuple[int, bool]] = []
        self.killed: list[int] = []
        self.removed: list[int] = []
        self.stops = 0
        self.shut_down = False
        self.generation_runs = 0
        self.avoid_nodes: set[str] = set()
        self.suspect_nodes: set[str] = set()
        self.applied = 0  # the last step the ranks applied (what a kept rank resumes after)
        self.snapshot_interval = 0  # the current generation's, from its snapshot plans
        self.run_call: _Run | None = None
        self.configure_call: tuple[FakeCalls, list[FakeSlot]] | None = None
        self._batches = 0
        self._made = 0
        self.cluster.group = self

    # ------------------------------------------------------------------ membership
    def _make_slots(
        self, count: int, *, batch_id: int, nodes: Sequence[str | None], state: SlotState
    ) -> list[FakeSlot]:
        made = []
        for offset in range(count):
            self._made += 1
            slot = FakeSlot(self._made - 1, batch_id=batch_id, node_id=nodes[offset] if offset < len(nodes) else None)
            slot.state = state
            self.slots.append(slot)
            made.append(slot)
        return made

    def start(self, mesh: MeshSpec, *, spare_replicas: int = 0) -> None:
        if (error := self.script.get("start_error")) is not None:
            raise error
        nodes: list[str | None] = list(self.script.get("nodes", []))
        for replica in range(mesh.dp_replicate + spare_replicas):
            first = replica * mesh.replica_size
            self._batches += 1
            self._make_slots(
                mesh.replica_size,
                batch_id=self._batches,
                nodes=nodes[first : first + mesh.replica_size],
                state=SlotState.WARM,
            )
        self.set_active(self.slots[: mesh.world_size])

    def start_replica_in_background(self, mesh: MeshSpec) -> bool:
        if not self.cluster.capacity:
            return False
        node = self.cluster.capacity.pop(0)
        self._batches += 1
        self._make_slots(
            mesh.replica_size, batch_id=self._batches, nodes=[node] * mesh.replica_size, state=SlotState.STARTING
        )
        return True

    def refresh(self) -> list[FakeSlot]:
        warmed = self.starting()
        for slot in warmed:
            slot.state = SlotState.WARM
        return warmed

    def warm(self) -> list[FakeSlot]:
        return [slot for slot in self.slots if slot.state == SlotState.WARM]

    def starting(self) -> list[FakeSlot]:
        return [slot for slot in self.slots if slot.state == SlotState.STARTING]

    def linger(self, slots: list[FakeSlot]) -> None:
        for slot in slots:
            slot.state = SlotState.LINGERING
        self.active = [slot for slot in self.active if slot.state == SlotState.ACTIVE]

    def lingering(self) -> list[FakeSlot]:
        return [slot for slot in self.slots if slot.state == SlotState.LINGERING]

    def kill(self, slots: list[FakeSlot]) -> None:
        self.killed += [slot.index for slot in slots]
        for slot in slots:
            self._died(slot)

    def remove(self, slots: list[FakeSlot]) -> None:
        doomed = {id(slot) for slot in slots}
        self.removed += [slot.index for slot in slots]
        for slot in slots:
            self._died(slot)
        self.slots = [slot for slot in self.slots if id(slot) not in doomed]
        self.active = [slot for slot in self.active if id(slot) not in doomed]

    def set_active(self, slots: list[FakeSlot]) -> None:
        for slot in self.slots:
            if slot.state == SlotState.ACTIVE:
                slot.state = SlotState.WARM
        for slot in slots:
            slot.state = SlotState.ACTIVE
        self.active = list(slots)

    def node_died(self, node: str) -> None:
        for slot in self.slots:
            if slot.node_id == node:
                self._died(slot)

    def _died(self, slot: FakeSlot) -> None:
        """``slot``'s process is gone: its calls in flight return DIED."""
        if self.run_call is not None and slot in self.run_call.slots:
            self.run_call.calls.release(self.run_call.slots.index(slot), DIED)
        if self.configure_call is not None and slot in self.configure_call[1]:
            self.configure_call[0].release(self.configure_call[1].index(slot), DIED)

    def _alive(self, slot: FakeSlot) -> bool:
        return slot in self.slots and slot.node_id not in self.cluster.dead and slot.index not in self.killed

    # ------------------------------------------------------------------ the driver's requests
    def _release_run(self, ranks: Iterable[int], status: RunStatus) -> None:
        run = self.run_call
        if run is None:
            return
        stuck = set(run.plan.get("stuck", ()))
        if run.plan.get("paced") and run.delivered < run.steps_done:
            # The step in flight completes; the later ones never run.
            run.steps_done = run.delivered + 1
            for queue in self.queued.values():
                queue[:] = [r for r in queue if not isinstance(r, StepReport) or r.step <= run.steps_done]
        for rank in ranks:
            if (
                rank not in stuck
                and self._alive(run.slots[rank])
                and run.slots[rank].node_id not in self.cluster.unreachable
            ):
                run.calls.release(rank, RunOutcome(status, run.steps_done))
        self.applied = run.steps_done

    def abort_step(self, generation: int, step: int, survivors: list[int]) -> None:
        self.aborted.append((generation, step))
        self._release_run(survivors, RunStatus.ABORTED)

    def request_pause(self, generation: int, *, checkpoint: bool = False) -> None:
        self.pauses.append((generation, checkpoint))
        if self.run_call is not None:
            if checkpoint and (saves := self.script.get("saves_to")) is not None:
                saves.commit(self.run_call.steps_done)  # the ranks' save at the boundary committed
            self._release_run(range(len(self.run_call.slots)), RunStatus.PAUSED)

    def request_stop(self) -> None:
        self.stops += 1
        if self.run_call is not None:
            self._release_run(range(len(self.run_call.slots)), RunStatus.STOPPED)

    def set_snapshot_interval(self, generation: int, interval_steps: int) -> None:
        pass

    # ------------------------------------------------------------------ fan-out
    def configure(
        self,
        *,
        generation: int,
        mesh: MeshSpec,
        starts: list[StartFrom],
        sync_replicas: bool,
        faults: tuple[FaultSpec, ...] = (),
        snapshots: Sequence[SnapshotPlan | None] = (),
    ) -> FakeCalls:
        self.configured.append(
            {
                "generation": generation,
                "mesh": mesh,
                "starts": starts,
                "sync": sync_replicas,
                "slots": [slot.index for slot in self.active],
                "faults": [fault.describe() for fault in faults],
            }
        )
        results: dict[int, Any] = {rank: self._configured_step(start) for rank, start in enumerate(starts)}
        results.update(self.script.get("configure_failures", {}).get(generation, {}))
        if starts and starts[0].mode == StartMode.CHECKPOINT and starts[0].step in self.script.get("corrupt", ()):
            results[0] = CallFailed(
                CallFailedKind.ERROR,
                f"CorruptCheckpointError: step {starts[0].step}: checksum mismatch",
                failure_kind=self.script.get("corrupt_kind", FailureKind.CORRUPT_CHECKPOINT),
            )
        self.snapshot_interval = next((plan.interval_steps for plan in snapshots if plan is not None), 0)
        if self.script.get("snapshots"):
            self._queue_snapshot_layouts(generation, mesh, snapshots)
            self._queue_memory_restores(starts)
        held = self.script.get("configure_held", {}).get(generation, ())
        calls = FakeCalls(results, after=self.script.get("configure_delay", 0), held=held)
        self.configure_call = (calls, list(self.active))
        return calls

    def _configured_step(self, start: StartFrom) -> int:
        """What a rank's configure returns: the step it resumes after."""
        if start.mode in (StartMode.CHECKPOINT, StartMode.MEMORY, StartMode.PEER):
            return start.step
        return 0 if start.mode == StartMode.FRESH else self.applied

    def _queue_snapshot_layouts(self, generation: int, mesh: MeshSpec, plans: Sequence[SnapshotPlan | None]) -> None:
        """Each rank's snapshot layout: it holds rows [2 rank, 2 rank + 2) of one weight."""
        for rank, plan in enumerate(plans):
            if plan is None:
                continue
            chunk = ChunkEntry("w", (2 * rank, 0), (2, 2), key="", start=0, end=16, block_rows=2, checksums=())
            tensor = TensorEntry("w", (2 * mesh.world_size, 2), "float32")
            self.queued.setdefault(rank, []).append(
                SnapshotLayoutReport(
                    rank, 0.0, generation, plan.buddy_rank, bytes=16, tensors=(tensor,), chunks=(chunk,)
                )
            )

    def _queue_memory_restores(self, starts: list[StartFrom]) -> None:
        for rank, start in enumerate(starts):
            if start.mode == StartMode.MEMORY:
                self.queued.setdefault(rank, []).append(
                    MemoryRestoreReport(rank, 0.0, start.step, bytes_local=8, bytes_remote=8, seconds=0.01)
                )

    def run(self, *, last_step: int) -> FakeCalls:
        self.generation_runs += 1
        plan: dict[str, Any] = self.script.get("runs", {}).get(self.generation_runs, {})
        generation = self.configured[-1]["generation"] if self.configured else 1
        first = self._resumed_after() + 1
        steps = plan.get("steps_done", last_step)
        world = len(self.active)
        interval = self.snapshot_interval if self.script.get("snapshots") else 0
        uncopied = set(plan.get("uncopied", ()))
        for rank in range(world):
            queue = self.queued.setdefault(rank, [])
            for step in range(first, steps + 1):
                queue.append(_step_report(rank, step, compute_s=0.1 * plan.get("slow", {}).get(rank, 1.0)))
                if interval and step % interval == 0:
                    queue.append(SnapshotReport(rank, 0.0, generation, step, copied=(step, rank) not in uncopied))
            queue.extend(plan.get("reports", {}).get(rank, ()))
        self.cluster.draining |= set(plan.get("draining", ()))
        for step in plan.get("commits", ()):
            self.script["saves_to"].commit(step)
        held = set(range(world)) if plan.get("held") == "all" else set(plan.get("held", ()))
        held |= set(plan.get("stuck", ()))
        digests = self.script.get("digests", {})
        outcomes: dict[int, Any] = {
            rank: RunOutcome(RunStatus.FINISHED, steps, state_digest=digests.get(rank, "same")) for rank in range(world)
        }
        outcomes.update(plan.get("outcomes", {}))
        calls = FakeCalls(outcomes, held=held - set(plan.get("outcomes", {})))
        self.run_call = _Run(calls, list(self.active), steps, plan)
        self.configure_call = None
        if not calls.held:
            self.applied = steps
        return calls

    def _resumed_after(self) -> int:
        """The step the ranks of the generation just configured resume after (what they answered)."""
        if self.configure_call is None:
            return 0
        answered = [step for step in self.configure_call[0].results.values() if isinstance(step, int)]
        return max(answered, default=0)

    def poll(self, timeout: float) -> dict[int, Heartbeat | CallFailed]:
        fake_time.advance(POLL_S)
        if self.script.get("unanswered_polls", 0) > 0:  # a loaded machine: no rank answers in time
            self.script["unanswered_polls"] -= 1
            return {}
        plan = self.run_call.plan if self.run_call is not None else {}
        upto: int | None = None  # with ``paced``: one more step's reports each poll
        if self.run_call is not None and plan.get("paced") and self.run_call.delivered < self.run_call.steps_done:
            self.run_call.delivered += 1
            upto = self.run_call.delivered
        answers: dict[int, Heartbeat | CallFailed] = {}
        for rank, slot in enumerate(self.active):
            if not self._alive(slot):
                answers[rank] = DIED
                continue
            if slot.node_id in self.cluster.unreachable:
                continue
            waiting = plan.get("waiting", {}).get(rank)
            answers[rank] = Heartbeat(
                rank=rank,
                phase=Phase.STEP,
                step=self.applied,
                phase_age_s=0.0,
                reports=tuple(self._take_reports(rank, upto=upto)),
                waiting=waiting,
                where="model.py:42" if waiting is False else None,
            )
        return answers

    def _take_reports(self, rank: int, *, upto: int | None) -> list[RankReport]:
        """Rank ``rank``'s queued reports, those of steps up to ``upto`` only when given."""
        queue = self.queued.pop(rank, [])
        if upto is None:
            return queue
        later = next((i for i, r in enumerate(queue) if isinstance(r, StepReport) and r.step > upto), len(queue))
        if later < len(queue):
            self.queued[rank] = queue[later:]
        return queue[:later]

    def shutdown(self, *, grace_s: float = 5.0) -> None:
        self.shut_down = True


def _step_report(rank: int, step: int, *, compute_s: float = 0.1) -> StepReport:
    return StepReport(
        phases={"data_s": 0.0, "compute_s": compute_s, "sync_s": 0.01, "optimizer_s": 0.01},
        rank=rank,
        time=fake_time.time(),
        step=step,
        loss=5.0 - step * 0.1 if rank == 0 else None,
        dp_rank=0,
        step_time_s=0.1,
        lr=0.001,
        grad_norm=1.0,
    )


def eval_report(step: int) -> EvalReport:
    """Rank 0's evaluation after ``step``."""
    return EvalReport(rank=0, time=0.0, step=step, loss=4.0, tokens=256, eval_s=0.01)


def replicas_on(*nodes: str, size: int) -> list[str]:
    """The ``nodes`` script entry for replica groups of ``size`` ranks, each on its node in turn."""
    return [node for node in nodes for _ in range(size)]


# The type checker holds the fake to the protocol the controller is written against.
FAKE_GROUP_CLASS: type[WorkerGroupProtocol[FakeSlot]] = FakeGroup
FAKE_SLOT: type[Slot] = FakeSlot
fake_time = FakeTime()


def fake_group(controller: Controller) -> FakeGroup:
    assert isinstance(controller.group, FakeGroup)
    return controller.group


@dataclass(frozen=True)
class FakeManifest:
    step: int
    mesh: dict[str, Any]


class FakeCheckpoints:
    """Committed checkpoints at ``steps``: what the controller asks of checkpoint commits."""

    enabled = True
    uri = "file:///fake"

    def __init__(self, steps: list[int], mesh: MeshSpec) -> None:
        self.mesh = mesh
        self.manifests = [FakeManifest(step, mesh.as_dict()) for step in sorted(steps)]
        self.resets: list[tuple[int, int | None, frozenset[int]]] = []  # (world size, paused_after, lost)

    def check_access(self) -> None:
        pass

    def on_report(self, report: object) -> None:
        pass

    def commit(self, step: int) -> None:
        self.manifests.append(FakeManifest(step, self.mesh.as_dict()))

    def reset(
        self, mesh: MeshSpec, *, generation: int, paused_after: int | None = None, lost: frozenset[int] = frozenset()
    ) -> None:
        self.resets.append((mesh.world_size, paused_after, lost))

    def latest_step(self) -> int | None:
        return self.manifests[-1].step if self.manifests else None

    def choose_resume(self, skip_steps: AbstractSet[int] = frozenset()) -> FakeManifest | None:
        intact = [manifest for manifest in self.manifests if manifest.step not in skip_steps]
        return intact[-1] if intact else None


# The demo config cut to a CPU-sized layout; tests add their own overrides.
BASE_OVERRIDES = ("training.steps=4", "parallelism.pp=1", "parallelism.tp=1")
ELASTIC = ("parallelism.dp_replicate=2", "parallelism.dp_shard=2", "parallelism.tp=1", "parallelism.pp=1")
ONE_REPLICA = ("parallelism.dp_replicate=1", "parallelism.dp_shard=4", "parallelism.tp=1", "parallelism.pp=1")

MakeController = Callable[..., Controller]


class EventTimes:
    """An event subscriber noting the fake clock's time of every event, in order."""

    def __init__(self) -> None:
        self.times: list[tuple[str, float]] = []

    def on_event(self, event: dict[str, Any]) -> None:
        self.times.append((event["event"], fake_time.now))

    def of(self, kind: str) -> list[float]:
        return [at for name, at in self.times if name == kind]


@pytest.fixture
def event_times() -> EventTimes:
    """When (on the fake clock) each event of the controller ``make_controller`` builds was emitted."""
    return EventTimes()


@pytest.fixture
def make_controller(tmp_path, monkeypatch, event_times) -> MakeController:
    """A controller over the fake group, on the fake cluster and the fake clock.

    ``make(*overrides, committed_steps=None, faults=(), chaos_seed=None, script=None, written_by=None)``:
    ``committed_steps``: checkpoints it finds committed (``FakeCheckpoints``, on
    ``controller.checkpoints``), written from ``written_by`` (default: the job's mesh);
    ``faults``: injected faults as ``--inject`` spells them; ``script``: ``FakeGroup.script``."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(Controller, "worker_group_class", FAKE_GROUP_CLASS)
    fake = FakeCluster()
    monkeypatch.setattr(FakeGroup, "cluster", fake)
    monkeypatch.setattr(FakeGroup, "script", {})
    for module in (controller_module, mesh_change, restore, polling, transitions):
        monkeypatch.setattr(module, "time", fake_time)
    monkeypatch.setattr(cluster, "draining_nodes", fake.draining_nodes)
    monkeypatch.setattr(cluster, "hosts_for", fake.hosts_for)
    monkeypatch.setattr(cluster, "dead_nodes", fake.dead_nodes)
    monkeypatch.setattr(cluster, "unreachable_nodes", fake.unreachable_nodes)
    events = EventLog(tmp_path / "events.jsonl", [event_times])

    def make(
        *overrides: str,
        committed_steps: list[int] | None = None,
        faults: tuple[str, ...] = (),
        chaos_seed: int | None = None,
        script: dict[str, Any] | None = None,
        written_by: MeshSpec | None = None,
    ) -> Controller:
        config = load_config(DEMO_CONFIG, [*BASE_OVERRIDES, *overrides])
        if script is not None:
            FakeGroup.script = script
        checkpoints = None
        if committed_steps is not None:
            checkpoints = FakeCheckpoints(committed_steps, written_by or config.mesh)
        built = Controller(
            config,
            events,
            poll_interval_s=0.0,
            checkpoints=checkpoints,
            faults=tuple(FaultSpec.parse(fault) for fault in faults),
            node_fault=fake.remove_node,
            network_fault=fake.apply,
            chaos_seed=chaos_seed,
        )
        built.detector.clock = fake_time.monotonic
        built.detector.reset(0)
        return built

    return make


@pytest.fixture
def controller(make_controller) -> Controller:
    return make_controller()


@pytest.fixture
def fake_cluster() -> FakeCluster:
    """The cluster of the controller ``make_controller`` builds."""
    return FakeGroup.cluster


def finish(controller: Controller, *, limit: int = 5000) -> Finished:
    """``controller.run()``, failing the test if the run takes more than ``limit`` steps (a fake
    whose ranks wait for something the driver never does)."""
    steps = 0
    step = controller.step

    def bounded() -> None:
        nonlocal steps
        steps += 1
        if steps > limit:
            raise AssertionError(f"the controller did not finish within {limit} steps; state {controller.state}")
        step()

    controller.step = bounded  # type: ignore[method-assign]
    return controller.run()


def events_of(tmp_path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events (of ``kind``)."""
    events = read_events(tmp_path / "events.jsonl")
    return events if kind is None else [event for event in events if event["event"] == kind]


def starts_of(configured: dict[str, Any]) -> list[tuple[str, int | None]]:
    """A configure call's starts as (mode, step) pairs; a kept or fresh rank's step is None."""
    return [
        (str(start.mode), None if start.mode in (StartMode.KEPT, StartMode.FRESH) else start.step)
        for start in configured["starts"]
    ]


def ranks_of(slots: Collection[FakeSlot]) -> list[int]:
    return sorted(slot.index for slot in slots)
