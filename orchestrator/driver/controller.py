"""The driver's control loop: an explicit state machine, one iteration per ``step()`` call.

Runs on the driver. States carry their data (``orchestrator.driver.states``, where the diagram
of the machine is); ``step()`` looks at the current state, calls that state's handler, which
does one bounded piece of work (start actors, wait a little for a configuration, poll the ranks
once) and returns the next state, or a ``NextGeneration`` that ``step()`` configures at once.
``run()`` calls ``step()`` until a terminal state. Tests drive it one iteration at a time with
a fake worker group (``Controller.worker_group_class``, any ``WorkerGroupProtocol``).

    Starting        Controller._start
    Configuring     Controller._await_configuration
    Running         Controller._supervise (and _housekeeping: drains, grows, spare actors)
    Settling        MeshChange.settle (mesh_change.py): shrink, refill, grow, or hand over to
    AwaitingActors  Restore.await_actors (restore.py): restore from peer memory or storage

Recovery in place never restarts a surviving process: survivors keep their slices, the
process groups are rebuilt under a new generation, replica groups that lost a rank leave
whole, and warm actors (spares, the healthy remainder of a broken replica) refill or grow the
mesh with state copied peer to peer from a surviving replica. docs/architecture.md follows a
rank's death through these modules.

The controller owns the worker group and the objects it steps with: ``RankPolls`` (polls,
progress), the ``Detector`` (losses), ``MeshChange`` and ``Restore`` (above), ``Replicas``
(replica books), ``TransitionTimer`` (recovery timings) and ``DriverFaults`` (injected driver
and node faults). They are built here, each handed what it uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from elastic.placement import RankResources
from elastic.policy import FailurePolicy, Grow, Reshape, ScalingPolicy, StateSource
from orchestrator.config import JobConfig
from orchestrator.driver import cluster
from orchestrator.driver.adoption import adoption_for
from orchestrator.driver.calls import CallFailed, CallFailedKind, run_status
from orchestrator.driver.checkpoint_commits import CheckpointCommits, driver_checkpoints
from orchestrator.driver.detector import Detector, DrainWatch, group_errors
from orchestrator.driver.group import Calls, Slot, WorkerGroupProtocol
from orchestrator.driver.mesh_change import MeshChange
from orchestrator.driver.peer_memory import snapshot_book
from orchestrator.driver.polling import RankPolls
from orchestrator.driver.rank_reports import ReportRouter, RouterHooks
from orchestrator.driver.replicas import Replicas, replicas_consistent
from orchestrator.driver.restore import Restore
from orchestrator.driver.sample_ledger import sample_ledger
from orchestrator.driver.states import (
    AwaitingActors,
    Configuring,
    Finished,
    Next,
    NextGeneration,
    RunEnd,
    Running,
    SettlePurpose,
    Settling,
    Starting,
    State,
    run_failed,
)
from orchestrator.driver.stragglers import StragglerWatch
from orchestrator.driver.train_spec import data_bytes, train_spec
from orchestrator.driver.transitions import TransitionTimer
from orchestrator.driver.worker_group import WorkerGroup
from orchestrator.observe.events import EventLog
from workers.faults import DriverFaults, FaultSpec, NetworkFault
from workers.spec.messages import (
    DrainNoticeReport,
    FailureKind,
    NoticeScope,
    ReportKind,
    RunOutcome,
    RunStatus,
    StartFrom,
    StartMode,
)

log = logging.getLogger("meshpilot")

# Seconds between looks at the cluster for drains and spare capacity (each is a GCS call).
HOUSEKEEPING_INTERVAL_S = 1.0
HEARTBEAT_EVENT_INTERVAL_S = 5.0
# A run call that ended so ends its generation as a failure.
ENDED_BADLY = (RunStatus.FAILED, RunStatus.ABORTED, CallFailedKind.DIED)


class Controller:
    """Owns the worker group and carries the run from start to a terminal state (driver side)."""

    worker_group_class: type[WorkerGroupProtocol[Any]] = WorkerGroup

    def __init__(
        self,
        config: JobConfig,
        events: EventLog,
        *,
        poll_interval_s: float = 0.25,
        faults: tuple[FaultSpec, ...] = (),
        node_fault: Callable[[str], None] | None = None,
        network_fault: Callable[[NetworkFault], None] | None = None,
        chaos_seed: int | None = None,
        checkpoints: CheckpointCommits | None = None,
    ) -> None:
        """Build the run's collaborators; nothing starts until the first ``step()``.
        ``checkpoints``: the job's checkpoint commits (by default ``config.checkpoint``'s)."""
        self.config = config
        self.chaos_seed = chaos_seed
        self.events = events
        self.poll_interval_s = poll_interval_s
        self.spec = train_spec(config)
        self.checkpoints = (
            checkpoints
            if checkpoints is not None
            else driver_checkpoints(config, events, lora_base=self.spec.lora_base)
        )
        runtime = config.runtime
        per_rank = RankResources(runtime.cpus_per_rank, runtime.gpus_per_rank, dict(runtime.resources_per_rank))
        self.group: WorkerGroupProtocol[Slot] = self.worker_group_class(
            spec=self.spec, data=data_bytes(config), per_rank=per_rank, start_timeout_s=runtime.start_timeout_s
        )
        self.replicas = Replicas(self.group, self.spec)
        self.failure_policy, self.scaling_policy = _policies(config)
        self.detector = Detector(
            heartbeat_timeout_s=config.elastic.heartbeat_timeout_s,
            hang_timeout_s=config.elastic.hang_timeout_s,
            first_step_timeout_s=config.elastic.compile_timeout_s if config.training.compile else 0.0,
            node_of=self.replicas.node_of,
            dead_nodes=self.replicas.dead_nodes,
            unreachable_nodes=self.replicas.unreachable_nodes,
        )
        self.faults = DriverFaults(
            faults, node_of=self.replicas.node_of, remove_node=node_fault, network_fault=network_fault
        )
        self.stragglers = StragglerWatch(
            config.elastic.straggler,
            events,
            node_of=self.replicas.node_of,
            suspect=self.group.suspect_nodes.add,
            min_replicas=config.elastic.min_replicas,
        )
        self.router = _report_router(config, events, self.faults, self.detector, self.stragglers)
        self.router.on(ReportKind.DRAIN_NOTICE, self._on_drain_notice)
        self.router.on(ReportKind.CHECKPOINT_UPLOAD, self.checkpoints.on_report)
        self.snapshots = snapshot_book(config, events, self.router, publish_interval=self.group.set_snapshot_interval)
        self.transitions = TransitionTimer(events, self.router)
        self.drains = DrainWatch(cluster.draining_nodes, lambda: cluster.hosts_for(per_rank))
        self.polls = RankPolls(
            self.group,
            self.detector,
            self.router,
            self.transitions,
            heartbeat_timeout_s=config.elastic.heartbeat_timeout_s,
        )
        self.restore = Restore(
            group=self.group,
            replicas=self.replicas,
            polls=self.polls,
            router=self.router,
            snapshots=self.snapshots,
            checkpoints=self.checkpoints,
            failure_policy=self.failure_policy,
            drains=self.drains,
            transitions=self.transitions,
            events=events,
            start_timeout_s=runtime.start_timeout_s,
            poll_interval_s=poll_interval_s,
        )
        self.mesh_change = MeshChange(
            group=self.group,
            replicas=self.replicas,
            detector=self.detector,
            drains=self.drains,
            polls=self.polls,
            router=self.router,
            snapshots=self.snapshots,
            checkpoints=self.checkpoints,
            failure_policy=self.failure_policy,
            scaling_policy=self.scaling_policy,
            restore=self.restore,
            transitions=self.transitions,
            faults=self.faults,
            events=events,
            collective_timeout_s=config.elastic.collective_timeout_s,
            poll_interval_s=poll_interval_s,
        )
        # runtime.survive_driver_loss: adopt a live run's ranks at the start, renew their leases.
        self.adoption = adoption_for(
            config, self.group, self.router, events, progress=lambda: (self.generation, self.router.last_emitted_step)
        )
        self.state: State = Starting(config.mesh)
        self.started_at = time.monotonic()
        self.generation = 0
        self._next_housekeeping = 0.0
        self._next_heartbeat_event = 0.0
        # After a finished run with several replica groups: did they end identical?
        self.replicas_consistent: bool | None = None
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
            self.state = Finished.of(RunEnd.FAILED, reason=str(error))
            raise
        finally:
            self.group.shutdown()
            self.adoption.close()
            final = self.state if isinstance(self.state, Finished) else Finished.of(RunEnd.FAILED)
            self.events.emit(
                "done",
                status=final.status,
                steps=self.polls.last_step,
                elapsed_s=round(time.monotonic() - self.started_at, 3),
                reason=final.reason,
                replicas_consistent=self.replicas_consistent,
            )
        return final

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
        """One iteration of the state machine: the current state's handler, then its next state."""
        self._emit_heartbeat()  # in every state: a long start-up or restore is not silence
        if self._terminate_requested and not self.done:
            self.state = self._preempt()
            return
        if self._interrupt_requested and not self.done:
            self.state = self._interrupt()
            return
        state = self.state
        following = self._handle(state)
        next_state = self._configure(following) if isinstance(following, NextGeneration) else following
        if isinstance(state, Configuring) and next_state is not state:
            # Configured or failed: no restore reads a stuck rank's snapshots now.
            self.group.remove(self.group.lingering())
        self.state = next_state

    def _handle(self, state: State) -> Next:
        """The handler of ``state``: each does one bounded piece of work and says what comes next."""
        match state:
            case Starting():
                return self._start(state)
            case Configuring():
                return self._await_configuration(state)
            case Running():
                return self._supervise(state)
            case Settling():
                return self.mesh_change.settle(state)
            case AwaitingActors():
                return self.restore.await_actors(state)
            case Finished():
                return state

    # ----------------------------------------------------------- start, configure
    def _start(self, state: Starting) -> NextGeneration:
        """The ``Starting`` handler: announce the run, start the actors, and configure the first
        generation: fresh, or resuming the newest intact checkpoint."""
        # Emitted before the actors start, so start-up counts against effective training time.
        self.events.emit(
            "start",
            run_dir=str(self.events.path.parent) if self.events.path else None,
            name=self.config.name,
            mesh=state.mesh.as_dict(),
            world_size=state.mesh.world_size,
            steps=self.spec.steps,
            global_batch=self.spec.global_batch,
            seq_len=self.spec.seq_len,
            config_hash=self.config.config_hash(),
        )
        if self.faults.pending:
            schedule = [fault.describe() for fault in self.faults.pending]
            log.warning(
                "fault schedule%s: %s",
                f" (--chaos {self.chaos_seed})" if self.chaos_seed is not None else "",
                " ".join(schedule),
            )
            self.events.emit("fault_schedule", seed=self.chaos_seed, faults=schedule)
        # Storage mistakes (credentials, bucket, endpoint) surface here, before any rank starts.
        self.checkpoints.check_access()
        resume = self.checkpoints.choose_resume() if self.config.checkpoint.resume else None
        adopted = self.adoption.adopt(resume.step if resume is not None else None)
        if adopted is not None:  # the live ranks of this run, left by a driver that died
            self.generation = adopted.generation
            # Saves the adopted generation's ranks still report commit with its mesh.
            self.checkpoints.reset(adopted.next.mesh, generation=adopted.generation)
            return adopted.next
        spares = -(-self.config.elastic.spare_actors // state.mesh.replica_size)  # whole replica groups
        self.group.start(state.mesh, spare_replicas=spares)
        if resume is not None:
            return self.restore.onto(state.mesh, resume.step, from_mesh=resume.mesh)
        return NextGeneration(state.mesh, (StartFrom(StartMode.FRESH),) * state.mesh.world_size)

    def _configure(self, generation: NextGeneration) -> Configuring:
        """Start ``generation`` on the active actors (every step that returns a ``NextGeneration``
        ends here): a new generation number, the router and the checkpoint commits on its mesh,
        and each rank's ``configure`` call with its start, the faults still armed and its
        peer-memory snapshot plan."""
        mesh = generation.mesh
        recovering = self.router.steps_emitted > 0  # a running job's mesh change, not its start
        self.generation += 1
        self.router.set_mesh(mesh)
        self.stragglers.reset(mesh)
        self.checkpoints.reset(
            mesh, generation=self.generation, paused_after=generation.paused_after, lost=generation.lost
        )
        calls = self.group.configure(
            generation=self.generation,
            mesh=mesh,
            starts=list(generation.starts),
            sync_replicas=generation.sync_replicas,
            faults=self.faults.for_generation(generation.restoring or self.polls.last_step),
            snapshots=self.snapshots.plans(self.generation, mesh, self.group.active),
        )
        now = time.monotonic()
        restoring = generation.restoring
        return Configuring(
            generation=self.generation,
            mesh=mesh,
            calls=calls,
            restoring=restoring,
            from_mesh=generation.from_mesh,
            started_at=now,
            deadline=now + self.config.runtime.start_timeout_s,
            recovering=recovering,
            stateless=frozenset(range(mesh.world_size)) if restoring is not None else generation.stateless,
            memory=generation.memory,
        )

    def _await_configuration(self, state: Configuring) -> Next:
        """The ``Configuring`` handler: wait a poll interval for the ranks' answers; once every
        rank configured, the generation runs."""
        state.calls.collect(self.poll_interval_s, first=True)
        # Reports keep coming while the ranks configure (the last generation's checkpoint uploads
        # end in the background): take them now, or a rank that dies configuring takes them
        # along. A poll not answered yet is kept for the next tick, so nothing waits for it.
        self.polls.take_reports(timeout=0.0)
        failed = {rank: r for rank, r in state.calls.results.items() if isinstance(r, CallFailed)}
        if failed:
            return self._configuration_failed(state, failed)
        if not state.calls.done:
            if time.monotonic() > state.deadline:
                missing = len(state.calls.refs) - len(state.calls.results)
                return run_failed(
                    "configuration",
                    f"{missing} ranks did not finish configuring within "
                    f"runtime.start_timeout_s={self.config.runtime.start_timeout_s:g}",
                )
            return state
        return self._begin_running(state)

    def _configuration_failed(self, state: Configuring, failed: dict[int, CallFailed]) -> Next:
        """Ranks failed to configure: restore around a corrupt checkpoint, replace ranks out of
        device memory, recover again when a running job's mesh change failed; else the run fails."""
        if state.memory is not None and any(f.failure_kind == FailureKind.STORAGE for f in failed.values()):
            self.snapshots.unusable(state.memory)  # a holder did not answer: the recovery picks another
        corrupt = [f for f in failed.values() if f.failure_kind == FailureKind.CORRUPT_CHECKPOINT]
        if corrupt and state.restoring is not None:
            return self.restore.around_corruption(state, state.restoring, corrupt[0])
        out_of_memory = {rank: f for rank, f in failed.items() if f.failure_kind == FailureKind.OUT_OF_MEMORY}
        if out_of_memory:
            return self.restore.replace_out_of_memory(state, out_of_memory)
        if state.recovering:
            return self.mesh_change.configuration_failed(state)
        return run_failed("configuration", group_errors({r: f.message for r, f in failed.items()}))

    def _begin_running(self, state: Configuring) -> Running:
        """Every rank configured: report a restore, and start the generation's training loops."""
        self.polls.last_step = max(state.calls.results.values())
        if state.restoring is not None:
            self.router.rewind(state.restoring)
            self.polls.take_reports()  # the ranks' restore reports: bytes read
            source = StateSource.PEER_MEMORY if state.memory is not None else StateSource.STORAGE
            self.events.emit(
                "restored",
                step=state.restoring,
                uri="peer-memory" if state.memory is not None else self.checkpoints.uri,
                from_mesh=state.from_mesh,
                to_mesh=state.mesh.as_dict(),
                restore_s=round(time.monotonic() - state.started_at, 3),
                source=source,
                **({"bytes_from_peers": self.snapshots.take_restore_bytes()} if state.memory is not None else {}),
            )
        self.detector.reset(state.mesh.world_size, self.polls.last_step)
        return Running(generation=state.generation, mesh=state.mesh, calls=self.group.run(last_step=self.spec.steps))

    # ------------------------------------------------------------------ running
    def _supervise(self, state: Running) -> State:
        """The ``Running`` handler: poll the ranks once; a loss (``Detector.losses``) or a rank's
        loop ending badly settles the generation (``MeshChange.begin_settling``)."""
        # Wakes at once when a rank's loop returns (a death, an error, the end); the reports a
        # rank queued before returning are drained right after (at the end, until all are in).
        state.calls.collect(timeout=self.poll_interval_s, first=True)
        self.polls.take_reports()
        lost = self.detector.losses(state.calls.results, hangs=True)
        returned = state.calls.results
        if lost or any(run_status(r) in ENDED_BADLY for r in returned.values()):
            return self.mesh_change.begin_settling(state, SettlePurpose.FAILURE, lost=lost)
        if state.calls.done:
            statuses = {run_status(r) for r in returned.values()}
            if statuses == {RunStatus.FINISHED}:
                # A poll slower than the drain above holds the last steps' reports (on a loaded
                # machine, every step of a short run): take them before the run ends.
                last = max(outcome.last_step for outcome in returned.values() if isinstance(outcome, RunOutcome))
                self.polls.await_step_reports(last, range(state.mesh.world_size))
                self.stragglers.take(state.mesh, warm_actors=0, ending=True)  # found in the last steps: reported
                self.replicas_consistent = replicas_consistent(state.mesh, returned)
                return Finished.of(RunEnd.FINISHED)
            if statuses == {RunStatus.PAUSED} and self.config.runtime.survive_driver_loss:
                # A pause nobody asked for: the store heard from no driver for a while (this one
                # was too busy to renew its lease) and paused the ranks. Go on from the boundary.
                log.warning("the ranks paused without a driver's request (a lapse of its lease): going on")
                return self.mesh_change.begin_settling(state, SettlePurpose.GROW)
            return run_failed("stopped", f"ranks ended with {sorted(str(status) for status in statuses)}")
        return self._housekeeping(state) or state

    def _housekeeping(self, state: Running) -> State | None:
        """Drains, grows and replacement actors, once a ``HOUSEKEEPING_INTERVAL_S``; returns a new
        state when the mesh must change."""
        if time.monotonic() < self._next_housekeeping:
            return None
        self._next_housekeeping = time.monotonic() + HOUSEKEEPING_INTERVAL_S
        draining = self.replicas.leaving(self.drains.nodes(), self.drains.retiring)
        if draining:
            return self.mesh_change.begin_settling(state, SettlePurpose.DRAIN, draining=draining)
        self.group.refresh()
        if (stragglers := self._straggler_move(state)) is not None:
            return stragglers
        decision = self.scaling_policy.decide(
            state.mesh, warm_actors=len(self.group.warm()), fits=self.replicas.fits, reshape=self.snapshots.enabled
        )
        if isinstance(decision, Grow | Reshape):
            return self.mesh_change.begin_settling(state, SettlePurpose.GROW)
        # Actors for replica groups the job wants and cannot form yet (or for the configured
        # mesh, to reshape back to), and the warm spares.
        wanted = self.scaling_policy.wanted_replicas(state.mesh) * state.mesh.replica_size
        if self.snapshots.enabled:
            wanted = max(wanted, self.scaling_policy.reshape_shortfall(state.mesh))
        self.replicas.top_up(state.mesh, wanted_ranks=wanted + self.config.elastic.spare_actors)
        return None

    def _straggler_move(self, state: Running) -> Settling | None:
        """Stragglers found since the last housekeeping: their replica groups leave at the step
        boundary like a drain (refilled from warm actors unless excluded), or they are only reported."""
        move = self.stragglers.take(state.mesh, warm_actors=len(self.group.warm()))
        if move is None:
            return None
        for rank in move.ranks:
            self.drains.retire(self.group.active[rank], reason="straggler")
        return self.mesh_change.begin_settling(
            state, SettlePurpose.DRAIN, draining=frozenset(move.ranks), refill=move.refill
        )

    def _on_drain_notice(self, report: DrainNoticeReport) -> None:
        """A rank reports a notice (handler of ``DRAIN_NOTICE`` reports, called by the router while
        the ranks are polled): the next housekeeping pauses the generation without its replica group."""
        rank = report.rank
        if rank is None or not 0 <= rank < len(self.group.active):
            return
        if report.scope == NoticeScope.PROCESS:
            # One process was signalled: its replica group leaves at the step boundary and its
            # actor is retired; the node and its other actors stay (they were told nothing).
            if self.drains.retire(self.group.active[rank]):
                log.warning(
                    "rank %s was told to end (%s): its replica group leaves at the step boundary", rank, report.reason
                )
            return
        node = self.replicas.node_of(rank)
        if node and self.drains.notice(node):
            log.warning("rank %s reports a drain notice for node %s: %s", rank, node, report.reason)
            self.group.avoid_nodes.add(node)

    def _emit_heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat_event:
            self._next_heartbeat_event = now + HEARTBEAT_EVENT_INTERVAL_S
            self.events.emit("heartbeat", rank_age_s=self.detector.heartbeat_ages())

    # ---------------------------------------------------------------- endings
    def _preempt(self, grace_s: float = 120.0) -> Finished:
        """SIGTERM on the driver: save at the next step boundary, commit, stop; a rerun resumes there."""
        if not isinstance(self.state, Running) or not self.checkpoints.enabled:
            log.warning(
                "terminated: stopping%s",
                "" if self.checkpoints.enabled else " (checkpoint.uri is not set: nothing is saved)",
            )
            return self._interrupt()
        log.warning("terminated: saving a checkpoint at the next step boundary, then stopping")
        self.group.request_pause(self.state.generation, checkpoint=True)
        self._let_ranks_return(self.state.calls, grace_s)
        saved = self.checkpoints.latest_step()
        return Finished.of(RunEnd.PREEMPTED, reason=f"terminated; checkpoint step {saved} is the place to resume from")

    def _interrupt(self, grace_s: float = 15.0) -> Finished:
        """Ctrl-C: let the step in flight finish everywhere, then stop (a second Ctrl-C stops at once)."""
        log.warning("interrupted: stopping after the step in flight (Ctrl-C again to stop at once)")
        self.group.request_stop()
        if isinstance(self.state, Running):
            self._let_ranks_return(self.state.calls, grace_s)
        return Finished.of(RunEnd.INTERRUPTED, reason="interrupted by the user")

    def _let_ranks_return(self, calls: Calls, grace_s: float) -> None:
        """Wait up to ``grace_s`` for every rank's loop to return (a stop or pause was asked),
        handling their reports (the last steps, the checkpoint's uploads) as they come; a
        Ctrl-C meanwhile stops waiting."""
        deadline = time.monotonic() + grace_s
        try:
            while not calls.done and time.monotonic() < deadline:
                calls.collect(timeout=0.2, first=True)
                self.polls.take_reports()
            self.polls.take_reports()
        except KeyboardInterrupt:
            log.warning("interrupted again: stopping now")


def _report_router(
    config: JobConfig, events: EventLog, faults: DriverFaults, detector: Detector, stragglers: StragglerWatch
) -> ReportRouter:
    """The run's report router, with its sample ledger and its hooks."""
    return ReportRouter(
        events,
        mesh=config.mesh,
        tokens_per_step=config.training.global_batch * config.training.seq_len,
        ledger=sample_ledger(
            events.path.parent if events.path else None,
            record_samples=config.data.record_samples,
            global_batch=config.training.global_batch,
        ),
        hooks=RouterHooks(
            # Injected driver and node faults fire the moment their step is known, before the
            # reports that came with it (a later step, a checkpoint's commit) are handled.
            after_step=faults.fire,
            after_eval=detector.evaluated,  # an evaluation is progress for the hang check
            step_reports=stragglers.on_step,  # each rank's compute time, for the straggler check
        ),
    )


def _policies(config: JobConfig) -> tuple[FailurePolicy, ScalingPolicy]:
    """The failure and scaling policies the job's elastic settings ask for."""
    elastic = config.elastic
    failure = FailurePolicy(
        min_replicas=elastic.min_replicas,
        max_replicas=elastic.max_replicas,
        max_failures=elastic.max_failures,
        window_s=elastic.failure_window_s,
    )
    scaling = ScalingPolicy(
        target_replicas=config.parallelism.dp_replicate, max_replicas=elastic.max_replicas, target_mesh=config.mesh
    )
    return failure, scaling
