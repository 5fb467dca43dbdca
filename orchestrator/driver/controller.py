"""The driver's control loop: an explicit state machine, one iteration per ``step()`` call.

Runs on the driver. States carry their data; ``step()`` looks at the current state, does one
bounded piece of work (start actors, wait a little for a configuration, poll the ranks once)
and moves to the next state. ``run()`` calls ``step()`` until a terminal state. Tests drive it
one iteration at a time with a fake worker group (``Controller.worker_group_class``).

    Starting -> Configuring -> Running -----------------------------> Finished
                     ^            | failure, drain notice, grow
                     |            v
                     +------- Settling: wait until every surviving rank has left the
                              generation (aborted step, or paused at a step boundary), then
                              let the policy decide: shrink / refill / grow, or fail

Recovery in place never restarts a surviving process: survivors keep their slices, the
process groups are rebuilt under a new generation, replica groups that lost a rank leave
whole, and warm actors (spares, the healthy remainder of a broken replica) refill or grow the
mesh with state copied peer to peer from a surviving replica.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from elastic.hardware import gpu_spec
from elastic.placement import RankResources
from elastic.planner import best_mesh
from elastic.policy import (
    Continue,
    Decision,
    Fail,
    FailurePolicy,
    GroupStatus,
    Grow,
    RestoreFromCheckpoint,
    ScalingPolicy,
    Shrink,
    restore_mesh,
)
from elastic.spec import MeshSpec
from orchestrator.driver import cluster
from orchestrator.driver.checkpoint_commits import driver_checkpoints
from orchestrator.config import JobConfig
from orchestrator.driver.detector import HANG_STEP_FACTOR, Detector, Lost
from orchestrator.observe.events import EventLog
from orchestrator.driver.train_spec import data_bytes, train_spec
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.worker_group import CallFailed, PendingCalls, RankSlot, WorkerGroup
from workers.spec.messages import RunOutcome, StartFrom
from workers.faults import FaultSpec

log = logging.getLogger("meshpilot")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143  # 128 + SIGTERM

# Seconds between looks at the cluster for drains and spare capacity (each is a GCS call).
HOUSEKEEPING_INTERVAL_S = 1.0
HEARTBEAT_EVENT_INTERVAL_S = 5.0
# How long survivors may take to leave a failed generation before they count as stuck.
SETTLE_TIMEOUT_S = 30.0
# While a generation fails, a rank that answers no poll for this long is counted lost.
SILENT_GRACE_S = 3.0
# After every survivor has left, how long to wait for Ray to name the cause (an actor's death
# is reported a moment after its peers see their connections close).
CAUSE_GRACE_S = 5.0


# ------------------------------------------------------------------------------ states
@dataclass(frozen=True)
class Starting:
    mesh: MeshSpec


@dataclass(frozen=True)
class Configuring:
    generation: int
    mesh: MeshSpec
    calls: PendingCalls
    deadline: float
    # Set when the ranks load a checkpoint: its step and the mesh that wrote it.
    restoring: int | None = None
    from_mesh: dict | None = None
    started_at: float = 0.0


@dataclass(frozen=True)
class AwaitingActors:
    """No replica survived: wait for enough actors to restore checkpoint ``step`` onto."""

    step: int
    mesh: MeshSpec
    began_at: float
    deadline: float
    lost_steps: int


@dataclass(frozen=True)
class Running:
    generation: int
    mesh: MeshSpec
    calls: PendingCalls


@dataclass(frozen=True)
class Settling:
    """A generation is ending: a failure (abort issued) or a pause for a drain or a grow."""

    generation: int
    mesh: MeshSpec
    calls: PendingCalls
    purpose: str  # failure | drain | grow
    lost: dict[int, Lost] = field(default_factory=dict)
    draining: frozenset[int] = frozenset()
    started_at: float = 0.0
    deadline: float = 0.0


@dataclass(frozen=True)
class Finished:
    status: str  # finished | failed | interrupted | preempted
    exit_code: int
    reason: str | None = None


State = Starting | Configuring | Running | Settling | AwaitingActors | Finished


@dataclass
class Transition:
    """A change of mesh in flight; reported once the first step on the new mesh completes."""

    kind: str  # recovered | grow
    began_at: float  # monotonic: the fault's detection, or the pause request
    began_wall: float
    old_mesh: MeshSpec
    new_mesh: MeshSpec
    resume_step: int
    lost_steps: int = 0
    added_ranks: tuple[int, ...] = ()
    cause: str = "failure"


class Controller:
    """Owns the worker group and carries the run from start to a terminal state (driver side)."""

    worker_group_class = WorkerGroup

    def __init__(self, config: JobConfig, events: EventLog, *, poll_interval_s: float = 0.25,
                 faults: tuple[FaultSpec, ...] = (), node_fault: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.events = events
        self.poll_interval_s = poll_interval_s
        self.spec = train_spec(config)
        self.router = ReportRouter(events, mesh=config.mesh,
                                   tokens_per_step=config.training.global_batch * config.training.seq_len)
        self.router.on("drain_notice", self._on_drain_notice)
        # Injected driver and node faults fire the moment their step is known, before the
        # reports that came with it (a later step, a checkpoint's commit) are handled.
        self.router.after_step = self._fire_driver_faults
        self.checkpoints = driver_checkpoints(config, events)
        self.router.on("checkpoint", self.checkpoints.on_report)
        self.group = self.worker_group_class(
            spec=self.spec, data=data_bytes(config),
            per_rank=RankResources(cpus=config.runtime.cpus_per_rank, gpus=config.runtime.gpus_per_rank,
                                   custom=dict(config.runtime.resources_per_rank)),
            start_timeout_s=config.runtime.start_timeout_s,
        )
        elastic = config.elastic
        self.failure_policy = FailurePolicy(min_replicas=elastic.min_replicas, max_replicas=elastic.max_replicas,
                                            max_failures=elastic.max_failures, window_s=elastic.failure_window_s)
        self.scaling_policy = ScalingPolicy(target_replicas=config.parallelism.dp_replicate,
                                            max_replicas=elastic.max_replicas)
        self.detector = Detector(heartbeat_timeout_s=elastic.heartbeat_timeout_s,
                                 hang_timeout_s=elastic.hang_timeout_s)
        self.pending_faults = [f for f in faults]
        self.node_fault = node_fault
        self.state: State = Starting(config.mesh)
        self.started_at = time.monotonic()
        self.last_step = 0
        self.generation = 0
        self.transition: Transition | None = None
        self._drain_nodes: set[str] = set()
        self._next_housekeeping = 0.0
        self._next_heartbeat_event = 0.0
        self._all_returned_at: float | None = None
        # After a finished run with several replica groups: did they end identical?
        self.replicas_consistent: bool | None = None
        self._corrupt_steps: set[int] = set()
        self._terminate_requested = False
        self._interrupt_requested = False

    # ------------------------------------------------------------------- loop
    @property
    def done(self) -> bool:
        return isinstance(self.state, Finished)

    def run(self) -> Finished:
        """Step until a terminal state; always shuts the group down and ends with a ``done`` event."""
        try:
            while not self.done:
                self.step()
        except KeyboardInterrupt:
            self.state = self._interrupt()
        except BaseException as error:
            self.state = Finished("failed", EXIT_FAILED, reason=str(error))
            raise
        finally:
            self.group.shutdown()
            self.events.emit("done", status=self.state.status, steps=self.last_step,
                             elapsed_s=round(time.monotonic() - self.started_at, 3), reason=self.state.reason,
                             replicas_consistent=self.replicas_consistent)
        return self.state

    def request_termination(self) -> None:
        """Signal-handler safe: the driver is going away (SIGTERM); save and stop at the next tick.

        A flag, not an exception: raised inside a Ray call, an exception would surface as a
        Ray error instead of reaching the controller.
        """
        self._terminate_requested = True

    def request_interrupt(self) -> None:
        """Signal-handler safe: Ctrl-C. The first stops after the step in flight (at the next
        tick); a second one stops at once."""
        if self._interrupt_requested:
            raise KeyboardInterrupt
        self._interrupt_requested = True

    def step(self) -> None:
        """One iteration of the state machine."""
        self._emit_heartbeat()  # in every state: a long start-up or restore is not silence
        if self._terminate_requested and not self.done:
            self.state = self._preempt()
            return
        if self._interrupt_requested and not self.done:
            self.state = self._interrupt()
            return
        state = self.state
        if isinstance(state, Starting):
            self.state = self._start(state)
        elif isinstance(state, Configuring):
            self.state = self._await_configuration(state)
        elif isinstance(state, Running):
            self.state = self._supervise(state)
        elif isinstance(state, Settling):
            self.state = self._settle(state)
        elif isinstance(state, AwaitingActors):
            self.state = self._await_actors(state)

    # ----------------------------------------------------------- start, configure
    def _start(self, state: Starting) -> State:
        # Emitted before the actors start, so start-up counts against effective training time.
        self.events.emit("start", run_dir=str(self.events.path.parent) if self.events.path else None,
                         name=self.config.name, mesh=state.mesh.as_dict(), world_size=state.mesh.world_size,
                         steps=self.spec.steps, global_batch=self.spec.global_batch, seq_len=self.spec.seq_len,
                         config_hash=self.config.config_hash())
        # Storage mistakes (credentials, bucket, endpoint) surface here, before any rank starts.
        self.checkpoints.check_access()
        resume = self.checkpoints.choose_resume() if self.config.checkpoint.resume else None
        spares = -(-self.config.elastic.spare_actors // state.mesh.replica_size)  # whole replica groups
        self.group.start(state.mesh, spare_replicas=spares)
        if resume is not None:
            return self._restore(state.mesh, resume.step, from_mesh=resume.mesh)
        starts = [StartFrom("fresh")] * state.mesh.world_size
        return self._configure(state.mesh, starts, sync_replicas=False)

    def _configure(self, mesh: MeshSpec, starts: list[StartFrom], *, sync_replicas: bool,
                   restoring: int | None = None, from_mesh: dict | None = None) -> Configuring:
        self.generation += 1
        self.router.set_mesh(mesh)
        self.checkpoints.reset(mesh)
        faults = tuple(f for f in self.pending_faults if f.step > (restoring or self.last_step))
        calls = self.group.configure(generation=self.generation, mesh=mesh, starts=starts,
                                     sync_replicas=sync_replicas, faults=faults)
        now = time.monotonic()
        return Configuring(self.generation, mesh, calls, deadline=now + self.config.runtime.start_timeout_s,
                           restoring=restoring, from_mesh=from_mesh, started_at=now)

    def _restore(self, mesh: MeshSpec, step: int, *, from_mesh: dict | None = None) -> Configuring:
        """Every active rank loads checkpoint ``step``, resharded to ``mesh``."""
        return self._configure(mesh, [StartFrom("checkpoint", step)] * mesh.world_size, sync_replicas=False,
                               restoring=step, from_mesh=from_mesh)

    def _await_configuration(self, state: Configuring) -> State:
        state.calls.collect(self.poll_interval_s, first=True)
        failed = {rank: r for rank, r in state.calls.results.items() if isinstance(r, CallFailed)}
        if failed and state.restoring is not None and any("CorruptCheckpointError" in f.message for f in failed.values()):
            return self._restore_around_corruption(state, failed)
        if failed:
            return self._fail("configuration", group_errors({r: f.message for r, f in failed.items()}))
        if not state.calls.done:
            if time.monotonic() > state.deadline:
                missing = len(state.calls.refs) - len(state.calls.results)
                return self._fail("configuration", f"{missing} ranks did not finish configuring within "
                                  f"runtime.start_timeout_s={self.config.runtime.start_timeout_s:g}")
            return state
        self.last_step = max(state.calls.results.values())
        if state.restoring is not None:
            self.router.rewind(state.restoring)
            self.events.emit("restored", step=state.restoring, uri=self.checkpoints.uri, from_mesh=state.from_mesh,
                             to_mesh=state.mesh.as_dict(), restore_s=round(time.monotonic() - state.started_at, 3))
        self.detector.reset(state.mesh.world_size, self.last_step)
        return Running(state.generation, state.mesh, self.group.run(last_step=self.spec.steps))

    def _restore_around_corruption(self, state: Configuring, failed: dict[int, CallFailed]) -> State:
        """A rank found a checksum mismatch while restoring: fall back to the previous committed step."""
        self._corrupt_steps.add(state.restoring)
        message = next(f.message for f in failed.values() if "CorruptCheckpointError" in f.message)
        log.warning("checkpoint step %s is corrupt (%s); falling back to the previous committed checkpoint",
                    state.restoring, message)
        previous = self.checkpoints.choose_resume(skip_steps=self._corrupt_steps)
        if previous is None:
            return self._fail("restore", f"no intact checkpoint left to restore: {message}")
        state.calls.collect(timeout=self.config.runtime.start_timeout_s)  # let the others finish first
        return self._restore(state.mesh, previous.step, from_mesh=previous.mesh)

    # ----------------------------------------------------------------- running
    def _supervise(self, state: Running) -> State:
        # Wakes at once when a rank's loop returns (a death, an error, the end); the reports a
        # rank queued before returning are drained right after.
        state.calls.collect(timeout=self.poll_interval_s, first=True)
        self._drain_reports()
        lost = self._losses(state)
        returned = state.calls.results
        if lost or any(_status(r) in ("failed", "died", "aborted") for r in returned.values()):
            return self._begin_settling(state, "failure", lost=lost)
        if state.calls.done:
            statuses = {_status(r) for r in returned.values()}
            if statuses == {"finished"}:
                self._check_replicas(state.mesh, returned)
                return Finished("finished", EXIT_OK)
            return self._fail("stopped", f"ranks ended with {sorted(statuses)}")
        if time.monotonic() >= self._next_housekeeping:
            self._next_housekeeping = time.monotonic() + HOUSEKEEPING_INTERVAL_S
            changed = self._housekeeping(state)
            if changed is not None:
                return changed
        return state

    def _check_replicas(self, mesh: MeshSpec, outcomes: dict[int, Any]) -> None:
        """Every replica group must end with bitwise-identical state; say so, or say where not."""
        by_slice: dict[tuple[int, int, int], set[str]] = {}
        for rank, outcome in outcomes.items():
            coords = mesh.coords(rank)
            by_slice.setdefault((coords.pp, coords.dp_shard, coords.tp), set()).add(outcome.state_digest)
        diverged = sorted(key for key, digests in by_slice.items() if len(digests) > 1)
        self.replicas_consistent = not diverged if mesh.dp_replicate > 1 else None
        if diverged:
            log.error("replica groups diverged at (pp, dp_shard, tp) = %s", diverged)

    def _losses(self, state: Running | Settling) -> dict[int, Lost]:
        lost: dict[int, Lost] = {}
        dead_nodes = self._dead_nodes(state) if any(_status(r) == "died" for r in state.calls.results.values()) else set()
        for rank, result in state.calls.results.items():
            node = self.group.active[rank].node_id if rank < len(self.group.active) else None
            finding = Detector.from_outcome(_as_outcome(result, self.last_step), node not in dead_nodes, node)
            if finding is not None:
                lost[rank] = finding
        for rank in self.detector.unresponsive():
            if rank not in state.calls.results:
                lost.setdefault(rank, Lost("unresponsive", f"no heartbeat for more than "
                                           f"elastic.heartbeat_timeout_s={self.config.elastic.heartbeat_timeout_s:g}"))
        if isinstance(state, Running):
            culprits = self.detector.hung()
            if culprits is not None:
                stalled = self.detector.stalled_for()
                for rank in culprits:
                    where = self.detector.where.get(rank) or "unknown"
                    lost.setdefault(rank, Lost("hang", f"no step completed for {stalled:.0f} s "
                                               f"(elastic.hang_timeout_s={self.config.elastic.hang_timeout_s:g}, "
                                               f"and {HANG_STEP_FACTOR:g} typical steps); busy at {where}"))
        return lost

    def _dead_nodes(self, state: Running | Settling) -> set[str]:
        nodes = {slot.node_id for slot in self.group.active if slot.node_id}
        return cluster.dead_nodes(nodes) if nodes else set()

    def _housekeeping(self, state: Running) -> State | None:
        """Drains, grows and replacement actors; returns a new state when the mesh must change."""
        draining = self._draining_ranks()
        if draining:
            return self._begin_settling(state, "drain", draining=draining)
        self.group.refresh()
        decision = self.scaling_policy.decide(state.mesh, warm_actors=len(self.group.warm()), fits=self._fits)
        if isinstance(decision, Grow):
            return self._begin_settling(state, "grow")
        self._start_replacements(state.mesh)
        return None

    def _start_replacements(self, mesh: MeshSpec) -> None:
        """Start actors in the background for replica groups the job wants and cannot form yet,
        and to keep the pool of warm spares full."""
        wanted = self.scaling_policy.wanted_replicas(mesh) * mesh.replica_size + self.config.elastic.spare_actors
        have = len(self.group.warm()) + len(self.group.starting())
        if wanted > have:
            self.group.start_replica_in_background(mesh)

    def _draining_ranks(self) -> frozenset[int]:
        nodes = set(self._drain_nodes)
        try:
            nodes |= cluster.draining_nodes()
        except Exception as error:  # noqa: BLE001 - a GCS hiccup must not end the run
            log.debug("could not read draining nodes: %s", error)
        if not nodes:
            return frozenset()
        stale = [slot for slot in self.group.warm() + self.group.starting() if slot.node_id in nodes]
        if stale:
            self.group.remove(stale)
        return frozenset(rank for rank, slot in enumerate(self.group.active) if slot.node_id in nodes)

    def _on_drain_notice(self, report: dict[str, Any]) -> None:
        rank = report.get("rank")
        if rank is not None and 0 <= rank < len(self.group.active):
            node = self.group.active[rank].node_id
            if node and node not in self._drain_nodes:
                log.warning("rank %s reports a drain notice for node %s: %s", rank, node, report.get("reason"))
                self._drain_nodes.add(node)
                self.group.avoid_nodes.add(node)

    # ---------------------------------------------------------------- settling
    def _begin_settling(self, state: Running, purpose: str, *, lost: dict[int, Lost] | None = None,
                        draining: frozenset[int] = frozenset()) -> Settling:
        now = time.monotonic()
        if purpose == "failure":
            hung = [self.group.active[rank] for rank, loss in (lost or {}).items() if loss.kind in ("hang", "unresponsive")]
            self.group.kill(hung)
            self._abort_generation(state, lost or {})
        else:
            if purpose == "drain":
                nodes = sorted({self.group.active[r].node_id for r in draining})
                self.events.emit("drain", node=nodes[0] if len(nodes) == 1 else nodes, ranks=sorted(draining),
                                 reason="node draining")
            elif purpose == "grow":
                # The grow event comes after the first step of the grown mesh; say now that one began.
                log.info("growing: %d warm actors can join %s at the next step boundary",
                         len(self.group.warm()), state.mesh.describe())
            everyone_leaves = purpose == "drain" and _replicas_of(state.mesh, draining) == state.mesh.dp_replicate
            self.group.request_pause(state.generation, checkpoint=everyone_leaves)
        return Settling(state.generation, state.mesh, state.calls, purpose, lost=dict(lost or {}),
                        draining=draining, started_at=now, deadline=now + SETTLE_TIMEOUT_S)

    def _abort_generation(self, state: Running | Settling, lost: dict[int, Lost]) -> None:
        survivors = [rank for rank in range(state.mesh.world_size) if rank not in lost]
        self.group.abort_step(state.generation, self.last_step + 1, survivors)

    def _settle(self, state: Settling) -> State:
        state.calls.collect(timeout=self.poll_interval_s, first=True)
        self._drain_reports()
        lost = {**self._losses(state), **state.lost}  # the first diagnosis stands (a hung rank, then killed)
        if lost and state.purpose != "failure":
            # A failure during a pause: treat it as a failure from here on.
            self._abort_generation(state, lost)
            state = Settling(state.generation, state.mesh, state.calls, "failure", lost, state.draining,
                             state.started_at, state.deadline)
        waiting_for = [rank for rank in range(len(state.calls.refs)) if rank not in state.calls.results
                       and rank not in lost]
        if waiting_for and state.purpose == "failure":
            lost.update(self._silent_while_failing(state, waiting_for))
            waiting_for = [rank for rank in waiting_for if rank not in lost]
        if waiting_for:
            if time.monotonic() < state.deadline:
                return Settling(state.generation, state.mesh, state.calls, state.purpose, lost, state.draining,
                                state.started_at, state.deadline)
            for rank in waiting_for:
                where = self.detector.where.get(rank) or "unknown"
                lost[rank] = Lost("stuck", f"did not leave generation {state.generation} within {SETTLE_TIMEOUT_S:g} s "
                                  f"(blocked at {where})")
        if state.purpose == "failure" and not lost and time.monotonic() < max(state.started_at, self._last_return(state)) + CAUSE_GRACE_S:
            return state
        return self._decide(state, lost)

    def _silent_while_failing(self, state: Settling, waiting_for: list[int]) -> dict[int, Lost]:
        """Ranks still out while their generation fails, and answering no poll: lost now.

        A live rank answers polls even while its loop is blocked; one that does not is dead or
        cut off, which Ray itself may take seconds more to conclude (a lost node).
        """
        now = time.monotonic()
        silent = [rank for rank in waiting_for
                  if now - self.detector.last_heard.get(rank, state.started_at) > SILENT_GRACE_S
                  and now - state.started_at > SILENT_GRACE_S]
        if not silent:
            return {}
        dead = self._dead_nodes(state)
        found = {}
        for rank in silent:
            node = self.group.active[rank].node_id
            if node in dead:
                found[rank] = Lost("node_lost", f"node {node} left the cluster", node)
            else:
                found[rank] = Lost("unresponsive", f"answered no poll for {SILENT_GRACE_S:g} s while its "
                                   "generation failed", node)
        self.group.kill([self.group.active[rank] for rank in silent])
        return found

    def _last_return(self, state: Settling) -> float:
        if self._all_returned_at is None and state.calls.done:
            self._all_returned_at = time.monotonic()
        return self._all_returned_at or time.monotonic()

    def _decide(self, state: Settling, lost: dict[int, Lost]) -> State:
        self._all_returned_at = None
        self._drain_reports(timeout=5.0)  # last reports of ranks about to leave, on a slow machine too
        applied = [r.last_step for rank, r in state.calls.results.items()
                   if rank not in lost and isinstance(r, RunOutcome)]
        resume_step = min(applied) if applied else self.last_step
        self.router.flush(resume_step)
        self.last_step = max(self.last_step, resume_step)
        if state.purpose == "failure" and not lost:
            # Every rank left without a cause being found (all echoes): the whole generation
            # counts as lost rather than retrying blindly.
            lost = {rank: Lost("rank_error", "left the generation without a cause") for rank in range(state.mesh.world_size)}
        if lost:
            self._emit_failure(lost)
        status = GroupStatus(mesh=state.mesh, lost_ranks=frozenset(lost), draining_ranks=state.draining,
                             warm_actors=len(self.group.warm()) + self._healthy_in_hit_replicas(state.mesh, lost, state.draining),
                             checkpoint_step=self.checkpoints.latest_step(), time=time.monotonic())
        if state.purpose == "grow":
            decision = self.scaling_policy.decide(state.mesh, warm_actors=len(self.group.warm()), fits=self._fits)
        else:
            # Whatever the restore lands on is decided once actors are at hand (AwaitingActors).
            decision = self.failure_policy.decide(status, fits=self._fits, restore_mesh=lambda: state.mesh)
        return self._carry_out(decision, state, lost, resume_step)

    def _carry_out(self, decision: Decision, state: Settling, lost: dict[int, Lost], resume_step: int) -> State:
        old_mesh = state.mesh
        began = state.started_at
        if isinstance(decision, Fail):
            return self._fail("policy", decision.reason)
        if isinstance(decision, Continue):
            decision = Shrink(old_mesh, drop=(), refill=0)  # a pause nobody needs any more: same mesh
        if isinstance(decision, Shrink):
            kept, spare_pool = self._split_replicas(old_mesh, lost, state.draining, decision.drop)
            refill = self._pick_warm(spare_pool, decision.refill * old_mesh.replica_size)
            new_mesh, added = decision.new_mesh, len(refill)
            active, starts = kept + refill, [StartFrom("kept")] * len(kept) + [StartFrom("peer", resume_step)] * added
            kind = "recovered"
        elif isinstance(decision, Grow):
            kept = list(self.group.active)
            refill = self._pick_warm(self.group.warm(), decision.add * old_mesh.replica_size)
            new_mesh, added = decision.new_mesh, len(refill)
            active, starts = kept + refill, [StartFrom("kept")] * len(kept) + [StartFrom("peer", resume_step)] * added
            kind = "grow"
        elif isinstance(decision, RestoreFromCheckpoint):
            return self._begin_restore(decision, state, lost, resume_step)
        else:
            return self._fail("policy", f"cannot carry out {decision!r}")
        self.group.set_active(active)
        self.transition = Transition(
            kind=kind, began_at=began, began_wall=time.time() - (time.monotonic() - began), old_mesh=old_mesh,
            new_mesh=new_mesh, resume_step=resume_step, lost_steps=max(0, self.router.last_emitted_step - resume_step),
            added_ranks=tuple(range(len(kept), len(active))), cause=state.purpose,
        )
        self._drain_nodes.clear()
        return self._configure(new_mesh, starts, sync_replicas=added > 0)

    def _begin_restore(self, decision: RestoreFromCheckpoint, state: Settling, lost: dict[int, Lost],
                       resume_step: int) -> AwaitingActors:
        """No complete replica survived: every healthy actor drops its state and waits for a restore."""
        gone = [self.group.active[rank] for rank in sorted(set(lost) | set(state.draining))]
        self.group.remove(gone)
        self.group.set_active([])
        now = time.monotonic()
        log.warning("no complete replica group survived: restoring checkpoint step %s (%d steps to redo)",
                    decision.step, resume_step - decision.step)
        return AwaitingActors(step=decision.step, mesh=state.mesh, began_at=state.started_at,
                              deadline=now + self.config.runtime.start_timeout_s,
                              lost_steps=max(0, resume_step - decision.step))

    def _await_actors(self, state: AwaitingActors) -> State:
        """Restore onto the largest mesh the warm actors can hold, starting more while they come."""
        self.group.refresh()
        warm = self.group.warm()
        if len(warm) < state.mesh.world_size and not self.group.starting():
            self.group.start_replica_in_background(state.mesh)  # False when no node has room
        target = self._restore_target(state.mesh, len(warm))
        out_of_time = time.monotonic() > state.deadline
        if target is None or (target != state.mesh and self.group.starting() and not out_of_time):
            if out_of_time:
                return self._fail("restore", "no capacity to restore the checkpoint onto within "
                                  f"runtime.start_timeout_s={self.config.runtime.start_timeout_s:g}")
            time.sleep(self.poll_interval_s)
            return state
        self.group.set_active(self._pick_warm(warm, target.world_size))
        self.transition = Transition(kind="recovered", began_at=state.began_at,
                                     began_wall=time.time() - (time.monotonic() - state.began_at),
                                     old_mesh=state.mesh, new_mesh=target, resume_step=state.step,
                                     lost_steps=state.lost_steps, cause="restore")
        self.last_step = state.step
        return self._restore(target, state.step)

    def _split_replicas(self, mesh: MeshSpec, lost: dict[int, Lost], draining: frozenset[int],
                        drop: tuple[int, ...]) -> tuple[list[RankSlot], list[RankSlot]]:
        """Survivors to keep (rank order) and healthy actors of dropped replicas (now warm)."""
        gone = [self.group.active[rank] for rank in sorted(set(lost) | set(draining))
                if rank < len(self.group.active)]
        kept, released = [], []
        for replica in mesh.replica_groups():
            slots = [self.group.active[rank] for rank in replica.ranks]
            if replica.index in drop:
                released.extend(slot for slot in slots if slot not in gone)
            else:
                kept.extend(slots)
        self.group.remove(gone)
        return kept, self.group.warm() + released

    @staticmethod
    def _pick_warm(pool: list[RankSlot], count: int) -> list[RankSlot]:
        # Actors started together (one placement group, one node) stay together.
        ordered = sorted(pool, key=lambda slot: (slot.batch_id, id(slot)))
        return ordered[:count] if len(ordered) >= count else []

    def _healthy_in_hit_replicas(self, mesh: MeshSpec, lost: dict[int, Lost], draining: frozenset[int]) -> int:
        hit = {mesh.replica_of(rank) for rank in set(lost) | set(draining)}
        return sum(1 for replica in mesh.replica_groups() if replica.index in hit
                   for rank in replica.ranks if rank not in lost and rank not in draining)

    def _restore_target(self, mesh: MeshSpec, available: int) -> MeshSpec | None:
        """The mesh to restore onto with ``available`` ranks: the planner's pick when it fits
        what the trainer can run, else the largest mesh keeping tp and pp."""
        if available >= mesh.world_size:
            return mesh
        planned = best_mesh(self.spec.model, available_ranks=available, gpus_per_node=max(1, mesh.tp),
                            hardware=gpu_spec(), global_batch=self.spec.global_batch, seq_len=self.spec.seq_len,
                            fixed={"tp": mesh.tp, "pp": mesh.pp}) if available > 0 else None
        if planned is not None and planned.world_size <= available and self._fits(planned):
            return planned
        return restore_mesh(mesh, available_ranks=available, fits=self._fits)

    def _fits(self, mesh: MeshSpec) -> bool:
        per_round = mesh.dp * self.spec.microbatches * self.spec.microbatch_size
        return self.spec.global_batch % per_round == 0

    def _emit_failure(self, lost: dict[int, Lost]) -> None:
        kinds = sorted({loss.kind for loss in lost.values()})
        nodes = sorted({loss.node for loss in lost.values() if loss.node})
        self.events.emit("failure", kind=kinds[0] if len(kinds) == 1 else ",".join(kinds), ranks=sorted(lost),
                         node=nodes[0] if len(nodes) == 1 else (nodes or None),
                         message=group_errors({rank: loss.message for rank, loss in lost.items()}),
                         # The tracebacks behind the one-line message, for whoever debugs it.
                         details={str(rank): loss.message for rank, loss in lost.items() if "\n" in loss.message})
        # Faults fired in this generation are consumed: a redo of the step must not fire them again.
        self.pending_faults = [f for f in self.pending_faults if f.step > self.router.last_emitted_step + 1]

    # ---------------------------------------------------------------- reports
    def _drain_reports(self, timeout: float = 1.0) -> None:
        for rank, heartbeat in self.group.poll(min(timeout, self.config.elastic.heartbeat_timeout_s)).items():
            if isinstance(heartbeat, CallFailed):
                continue  # a dead actor: its run call says so
            self.detector.heard(rank, heartbeat.waiting, heartbeat.where)
            self.router.route(heartbeat.reports)
        self.last_step = max(self.last_step, self.router.last_emitted_step)
        self.detector.stepped(self.router.last_emitted_step, self.router.last_step_time_s)
        self._report_transition()

    def _report_transition(self) -> None:
        transition = self.transition
        if transition is None or self.router.last_emitted_step <= transition.resume_step:
            return
        completed_at = self.router.completed_at.get(transition.resume_step + 1, time.time())
        elapsed = round(completed_at - transition.began_wall, 3)
        if transition.kind == "grow":
            self.events.emit("grow", new_mesh=transition.new_mesh.as_dict(), added_ranks=list(transition.added_ranks),
                             join_s=elapsed, old_mesh=transition.old_mesh.as_dict())
        else:
            self.events.emit("recovered", mttr_s=elapsed, lost_steps=transition.lost_steps,
                             old_mesh=transition.old_mesh.as_dict(), new_mesh=transition.new_mesh.as_dict(),
                             cause=transition.cause, refilled_ranks=list(transition.added_ranks))
        self.transition = None

    def _emit_heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat_event:
            self._next_heartbeat_event = now + HEARTBEAT_EVENT_INTERVAL_S
            self.events.emit("heartbeat", rank_age_s=self.detector.heartbeat_ages())

    def _fire_driver_faults(self) -> None:
        for fault in [f for f in self.pending_faults if f.kind in ("driver", "node")]:
            if self.router.last_emitted_step < fault.step:
                continue
            self.pending_faults.remove(fault)
            if fault.kind == "driver":
                log.warning("firing injected fault %s: killing the driver", fault.describe())
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.node_fault is not None and fault.rank < len(self.group.active):
                log.warning("firing injected fault %s", fault.describe())
                self.node_fault(self.group.active[fault.rank].node_id)

    # ---------------------------------------------------------------- endings
    def _fail(self, kind: str, message: str) -> Finished:
        log.error("run failed (%s): %s", kind, message)
        return Finished("failed", EXIT_FAILED, reason=message)

    def _preempt(self, grace_s: float = 120.0) -> Finished:
        """SIGTERM on the driver: save at the next step boundary, commit, stop; a rerun resumes there."""
        if not isinstance(self.state, Running) or not self.checkpoints.enabled:
            log.warning("terminated: stopping%s", "" if self.checkpoints.enabled else " (checkpoint.uri is not set: "
                        "nothing is saved)")
            return self._interrupt()
        log.warning("terminated: saving a checkpoint at the next step boundary, then stopping")
        self.group.request_pause(self.state.generation, checkpoint=True)
        self._let_ranks_return(grace_s)
        saved = self.checkpoints.latest_step()
        return Finished("preempted", EXIT_PREEMPTED,
                        reason=f"terminated; checkpoint step {saved} is the place to resume from")

    def _interrupt(self, grace_s: float = 15.0) -> Finished:
        """Ctrl-C: let the step in flight finish everywhere, then stop (a second Ctrl-C stops at once)."""
        log.warning("interrupted: stopping after the step in flight (Ctrl-C again to stop at once)")
        self.group.request_stop()
        if isinstance(self.state, Running):
            self._let_ranks_return(grace_s)
        return Finished("interrupted", EXIT_INTERRUPTED, reason="interrupted by the user")

    def _let_ranks_return(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for every rank's loop to return (a stop or pause was asked),
        handling their reports (the last steps, the checkpoint's uploads) as they come; a
        Ctrl-C meanwhile stops waiting."""
        deadline = time.monotonic() + grace_s
        try:
            while not self.state.calls.done and time.monotonic() < deadline:
                self.state.calls.collect(timeout=0.2, first=True)
                self._drain_reports()
            self._drain_reports()
        except KeyboardInterrupt:
            log.warning("interrupted again: stopping now")


def group_errors(messages: dict[int, str]) -> str:
    """Identical failures print once: ``[Rank 0, 1]: message``."""
    by_message: dict[str, list[int]] = {}
    for rank, text in sorted(messages.items()):
        by_message.setdefault(_last_line(text), []).append(rank)
    return "; ".join(f"[Rank {', '.join(map(str, ranks))}]: {message}" for message, ranks in by_message.items())


def _as_outcome(result: Any, last_step: int) -> RunOutcome:
    if isinstance(result, CallFailed):
        status = "died" if result.kind == "died" else "failed"
        return RunOutcome(status, last_step, error=result.message, error_type=result.kind)
    return result


def _status(result: Any) -> str:
    if isinstance(result, CallFailed):
        return "died" if result.kind == "died" else "failed"
    return result.status


def _replicas_of(mesh: MeshSpec, ranks: frozenset[int]) -> int:
    return len({mesh.replica_of(rank) for rank in ranks})


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text
