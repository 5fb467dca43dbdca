"""Changing the mesh: how the controller settles a generation that ends and starts the next.

Runs on the driver, as part of ``Controller`` (a mixin: these are its methods, kept here so the
controller module holds the loop and this one the recovery, drain and grow path). A generation
ends on a failure (abort issued), a drain or a grow (a pause at the step boundary); once every
surviving rank has left, the failure or scaling policy decides, and the decision is carried out:
shrink or refill in place, grow, restore from a checkpoint, or fail.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import replace

from elastic.policy import (
    Continue,
    Decision,
    Fail,
    FailurePolicy,
    GroupStatus,
    Grow,
    Reshape,
    RestoreFromCheckpoint,
    ScalingPolicy,
    Shrink,
)
from elastic.spec import MeshSpec
from orchestrator.config import JobConfig
from orchestrator.driver.checkpoint_commits import DriverCheckpoints, NoCheckpoints
from orchestrator.driver.detector import Detector, DrainWatch, LossKind, Lost, failure_fields, stuck_ranks
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from orchestrator.driver.peer_memory import RecoveryPoint, SnapshotBook
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.replicas import Replicas, replicas_of
from orchestrator.driver.states import Configuring, Finished, Running, SettlePurpose, Settling, State
from orchestrator.driver.transitions import TransitionKind, TransitionTimer
from orchestrator.observe.events import EventLog
from workers.faults import DriverFaults
from workers.spec.messages import RunOutcome, StartFrom, StartMode

log = logging.getLogger("meshpilot")

# After every survivor has left, how long to wait for Ray to name the cause (an actor's death
# is reported a moment after its peers see their connections close).
CAUSE_GRACE_S = 5.0
# Losses whose process may still hold the step (or a socket): killed when the generation fails.
KILLED_ON_FAILURE = (LossKind.HANG, LossKind.UNRESPONSIVE)


class MeshChanges:
    """The controller's settling and mesh-change steps (see ``Controller``, which mixes them in)."""

    # What these steps use of the controller (set in ``Controller.__init__``).
    config: JobConfig
    events: EventLog
    group: WorkerGroupProtocol[Slot]
    replicas: Replicas
    detector: Detector
    router: ReportRouter
    checkpoints: DriverCheckpoints | NoCheckpoints
    failure_policy: FailurePolicy
    scaling_policy: ScalingPolicy
    transitions: TransitionTimer
    faults: DriverFaults
    drains: DrainWatch
    snapshots: SnapshotBook
    poll_interval_s: float
    last_step: int

    # The controller's own steps these call.
    def _drain_reports(self, timeout: float = 1.0) -> None:
        raise NotImplementedError

    def _fail(self, kind: str, message: str) -> Finished:
        raise NotImplementedError

    def _configure(
        self,
        mesh: MeshSpec,
        starts: list[StartFrom],
        *,
        sync_replicas: bool,
        restoring: int | None = None,
        from_mesh: dict | None = None,
        stateless: frozenset[int] = frozenset(),
        memory: RecoveryPoint | None = None,
        paused_after: int | None = None,
        lost: frozenset[int] = frozenset(),
    ) -> Configuring:
        raise NotImplementedError

    def _restore(
        self,
        mesh: MeshSpec,
        step: int,
        *,
        from_mesh: dict | None = None,
        memory: RecoveryPoint | None = None,
        paused_after: int | None = None,
    ) -> Configuring:
        raise NotImplementedError

    # The restore steps (``orchestrator.driver.restores``).
    def _begin_restore(
        self, decision: RestoreFromCheckpoint, state: Settling, lost: dict[int, Lost], resume_step: int
    ) -> State:
        raise NotImplementedError

    def _reshape(self, state: Settling, new_mesh: MeshSpec, resume_step: int) -> State:
        raise NotImplementedError

    def _begin_settling(
        self,
        state: Running,
        purpose: SettlePurpose,
        *,
        lost: dict[int, Lost] | None = None,
        draining: frozenset[int] = frozenset(),
    ) -> Settling:
        now = time.monotonic()
        lost = dict(lost or {})
        if purpose == SettlePurpose.FAILURE:
            self._abort_generation(state, lost)
        else:
            self._request_pause(state, purpose, draining)
        return Settling(
            generation=state.generation,
            mesh=state.mesh,
            calls=state.calls,
            purpose=purpose,
            lost=lost,
            draining=draining,
            started_at=now,
            deadline=self._settle_deadline(purpose, now),
        )

    def _settle_deadline(self, purpose: SettlePurpose, now: float, *, configuring: bool = False) -> float:
        """When ranks still out of the settling generation count as stuck. A pause has no
        deadline: its ranks finish the step they are in (and a drain's save), and a hang or
        silence there is caught as while running (``_settle``), by the configured timeouts."""
        return now + self._unwind_s(configuring) if purpose == SettlePurpose.FAILURE else math.inf

    def _unwind_s(self, configuring: bool) -> float:
        """How long survivors of an aborted generation may take to leave it: the configured hang
        threshold; while configuring, at least the collective timeout, since a rank inside torch's
        rendezvous (a peer died after the join barrier) cannot be interrupted."""
        threshold = self.detector.hang_threshold_s()
        return max(threshold, self.config.elastic.collective_timeout_s + 5.0) if configuring else threshold

    def _configuration_failed(self, state: Configuring) -> Settling:
        """A rank failed while a running job's new mesh was configured (a fault during a
        recovery, a grow or a restore): the configuring generation fails like a running one, and
        the recovery starts again from what is left. Ranks that kept their state still hold it;
        joiners and restoring ranks hold none (``stateless``), so their replica groups are not
        kept. Survivors may wait in the new groups' rendezvous for a rank that will never come:
        they are given the collective timeout to come back before counting as stuck (``_unwind_s``),
        or only the hang threshold when the peer-memory snapshot is whole without them
        (``_held_elsewhere``)."""
        now = time.monotonic()
        log.warning("a rank failed while generation %s was configured: recovering again", state.generation)
        # The detector still knows the last running generation's ranks: this one's are judged now.
        self.detector.reset(state.mesh.world_size, self.last_step)
        settling = Settling(
            generation=state.generation,
            mesh=state.mesh,
            calls=state.calls,
            purpose=SettlePurpose.FAILURE,
            started_at=now,
            deadline=self._settle_deadline(SettlePurpose.FAILURE, now, configuring=True),
            stateless=state.stateless,
            configuring=True,
        )
        self._abort_generation(settling, {})
        return settling

    def _request_pause(self, state: Running, purpose: SettlePurpose, draining: frozenset[int]) -> None:
        """Every rank stops after the step it is in; with every replica draining, saves first."""
        if purpose == SettlePurpose.DRAIN:
            nodes = sorted({node for rank in draining if (node := self.replicas.node_of(rank))})
            signalled = all(self.group.active[rank] in self.drains.retiring for rank in draining)
            self.events.emit(
                "drain",
                node=nodes[0] if len(nodes) == 1 else nodes,
                ranks=sorted(draining),
                reason="process told to end" if signalled else "node draining",
            )
        elif purpose == SettlePurpose.GROW:
            # The grow event comes after the first step of the grown mesh; say now that one began.
            log.info(
                "growing: %d warm actors can join %s at the next step boundary",
                len(self.group.warm()),
                state.mesh.describe(),
            )
        everyone_leaves = (
            purpose == SettlePurpose.DRAIN and replicas_of(state.mesh, draining) == state.mesh.dp_replicate
        )
        self.group.request_pause(state.generation, checkpoint=everyone_leaves)

    def _abort_generation(self, state: Running | Settling, lost: dict[int, Lost]) -> None:
        """Kill the lost ranks whose process may still hold the step, veto the step in flight
        and abort the survivors' process groups."""
        self.group.kill([self.group.active[rank] for rank, loss in lost.items() if loss.kind in KILLED_ON_FAILURE])
        survivors = [rank for rank in range(state.mesh.world_size) if rank not in lost]
        self.group.abort_step(state.generation, self.last_step + 1, survivors)

    def _settle(self, state: Settling) -> State:
        state.calls.collect(timeout=self.poll_interval_s, first=True)
        self._drain_reports()
        # The first diagnosis stands (a hung rank, then killed, is still hung). During a pause
        # the ranks still train their last step: a hang there is found as while running.
        pausing = state.purpose != SettlePurpose.FAILURE
        lost = {**self.detector.losses(state.calls.results, hangs=pausing), **state.lost}
        if lost and pausing:
            # A failure during a pause: treat it as a failure from here on.
            self._abort_generation(state, lost)
            now = time.monotonic()
            state = replace(
                state,
                purpose=SettlePurpose.FAILURE,
                lost=dict(lost),
                deadline=self._settle_deadline(SettlePurpose.FAILURE, now),
            )
        waiting_for = [
            rank for rank in range(len(state.calls.refs)) if rank not in state.calls.results and rank not in lost
        ]
        if waiting_for and state.purpose == SettlePurpose.FAILURE:
            silent = self.detector.silent_while_failing(waiting_for, since=state.started_at)
            if silent:
                self.group.kill([self.group.active[rank] for rank in silent])
            lost.update(silent)
            waiting_for = [rank for rank in waiting_for if rank not in lost]
        if waiting_for:
            now = time.monotonic()
            if now < state.deadline and not self._held_elsewhere(state, lost, now):
                return replace(state, lost=lost)
            lost.update(
                self.detector.stuck(waiting_for, generation=state.generation, within_s=round(now - state.started_at, 1))
            )
        if state.purpose == SettlePurpose.FAILURE and not lost:
            # Every rank left and no cause is known yet: give Ray a moment to name it.
            state = state.noting_returns(time.monotonic())
            if time.monotonic() < max(state.started_at, state.all_returned_at or time.monotonic()) + CAUSE_GRACE_S:
                return state
        return self._decide(state, lost)

    def _await_step_reports(self, resume_step: int, survivors: Iterable[int]) -> None:
        """Drain until the survivors' reports of every step up to ``resume_step`` are in, or the
        heartbeat timeout passed. On a loaded machine a rank can answer a poll after one drain
        gave up on it; a step of the old mesh left without an event would hold back every later
        one (the router emits steps in order)."""
        deadline = time.monotonic() + self.config.elastic.heartbeat_timeout_s
        while not self.router.reported(resume_step, survivors) and time.monotonic() < deadline:
            self._drain_reports(timeout=1.0)

    def _held_elsewhere(self, state: Settling, lost: dict[int, Lost], now: float) -> bool:
        """Whether the ranks still inside a failed configuration need not be waited for any more.

        They may sit in torch's rendezvous, out of reach of the abort, until the collective
        timeout (``_unwind_s``: minutes). Past the hang threshold that wait saves nothing when the
        peer-memory snapshot of the step the job resumes from is whole with them counted as
        holders: as stuck ranks their actors linger and serve it, and no step is lost."""
        if not state.configuring or now < state.started_at + self.detector.hang_threshold_s():
            return False
        memory = self._memory_without(lost, state.draining)
        return memory is not None and memory.step >= self.last_step

    def _memory_without(self, lost: dict[int, Lost], draining: frozenset[int]) -> RecoveryPoint | None:
        """The newest whole peer-memory snapshot once ``lost`` and ``draining`` ranks are gone; a
        stuck rank's actor is alive and serves its snapshots to a restore before it is killed."""
        holders_leaving = (set(lost) - stuck_ranks(lost)) | draining
        return self.snapshots.recoverable(self.replicas.gone_besides(holders_leaving))

    def _decide(self, state: Settling, lost: dict[int, Lost]) -> State:
        self._drain_reports(timeout=5.0)  # last reports of ranks about to leave, on a slow machine too
        survivors = {
            rank: outcome.last_step
            for rank, outcome in state.calls.results.items()
            if rank not in lost and isinstance(outcome, RunOutcome)
        }
        applied = list(survivors.values())
        resume_step = min(applied) if applied else self.last_step
        self._await_step_reports(resume_step, survivors)
        self.snapshots.applied(state.generation, max(applied, default=0))
        self.router.flush(resume_step)
        self.last_step = max(self.last_step, resume_step)
        if state.purpose == SettlePurpose.FAILURE and not lost:
            # Every rank left without a cause being found (all echoes): the whole generation
            # counts as lost rather than retrying blindly.
            lost = {
                rank: Lost(LossKind.RANK_ERROR, "left the generation without a cause")
                for rank in range(state.mesh.world_size)
            }
        if lost:
            self.events.emit("failure", **failure_fields(lost))
            # Warm and starting actors on a lost node died with it: none may be picked to join.
            self.replicas.leaving(
                {loss.node for loss in lost.values() if loss.kind == LossKind.NODE_LOST and loss.node}
            )
            # Faults fired in this generation are consumed: a redo of the step must not fire them again.
            self.faults.consume_after_failure(self.router.last_emitted_step, configuring=state.configuring)
        # Stateless ranks (a failed configuration's joiners) are healthy but cannot be kept: to
        # the policy their replica groups leave as if draining; the actors go warm.
        leaving = state.draining | (state.stateless - set(lost))
        warm = len(self.group.warm()) + self.replicas.healthy_in_hit_replicas(
            state.mesh, lost, state.draining, state.stateless
        )
        memory = self._memory_without(lost, state.draining)
        status = GroupStatus(
            mesh=state.mesh,
            lost_ranks=frozenset(lost),
            draining_ranks=leaving,
            warm_actors=warm,
            checkpoint_step=self.checkpoints.latest_step(),
            memory_step=memory.step if memory is not None else None,
            time=time.monotonic(),
            completed_step=self.router.steps_emitted,
        )
        if state.purpose == SettlePurpose.GROW:
            decision = self.scaling_policy.decide(
                state.mesh, warm_actors=len(self.group.warm()), fits=self.replicas.fits, reshape=self.snapshots.enabled
            )
        else:
            # Whatever the restore lands on is decided once actors are at hand (AwaitingActors).
            decision = self.failure_policy.decide(status, fits=self.replicas.fits, restore_mesh=lambda: state.mesh)
        return self._carry_out(decision, state, lost, resume_step)

    def _carry_out(self, decision: Decision, state: Settling, lost: dict[int, Lost], resume_step: int) -> State:
        if isinstance(decision, Fail):
            return self._fail("policy", decision.reason)
        if isinstance(decision, RestoreFromCheckpoint):
            return self._begin_restore(decision, state, lost, resume_step)
        if isinstance(decision, Reshape):
            return self._reshape(state, decision.new_mesh, resume_step)
        if isinstance(decision, Continue):
            decision = Shrink(state.mesh, drop=(), refill=0)  # a pause nobody needs any more: same mesh
        if isinstance(decision, Shrink):
            kept, joining = self.replicas.shrink(
                state.mesh, lost, state.draining, drop=decision.drop, refill=decision.refill
            )
            kind = TransitionKind.RECOVERED
        elif isinstance(decision, Grow):
            kept, joining = self.replicas.grow(state.mesh, add=decision.add)
            kind = TransitionKind.GROW
        else:
            return self._fail("policy", f"cannot carry out {decision!r}")
        return self._change_mesh(
            state, decision.new_mesh, kept, joining, kind=kind, resume_step=resume_step, lost=frozenset(lost)
        )

    def _change_mesh(
        self,
        state: Settling,
        new_mesh: MeshSpec,
        kept: list[Slot],
        joining: list[Slot],
        *,
        kind: TransitionKind,
        resume_step: int,
        lost: frozenset[int],
    ) -> Configuring:
        """``kept`` ranks rebind the slices they hold; ``joining`` ones receive theirs from a
        surviving replica (every rank then syncs replicas). The old mesh's checkpoint uploads
        still in flight go on and commit without the ``lost`` ranks (a pause loses none) while
        a whole replica survived: a save the lost ranks took part in needs only the slices
        written by the survivors (copies of other replicas are not written)."""
        self.group.set_active(kept + joining)
        starts = [StartFrom(StartMode.KEPT)] * len(kept) + [StartFrom(StartMode.PEER, resume_step)] * len(joining)
        self.transitions.begin(
            kind,
            began_at=state.started_at,
            old_mesh=state.mesh,
            new_mesh=new_mesh,
            resume_step=resume_step,
            lost_steps=max(0, self.router.last_emitted_step - resume_step),
            added_ranks=tuple(range(len(kept), len(kept) + len(joining))),
            cause=state.purpose,
        )
        self.drains.clear()
        joined = frozenset(range(len(kept), len(kept) + len(joining)))
        return self._configure(
            new_mesh,
            starts,
            sync_replicas=len(joining) > 0,
            stateless=joined,
            paused_after=resume_step if _a_replica_survived(state.mesh, lost) else None,
            lost=lost,
        )


def _a_replica_survived(mesh: MeshSpec, lost: frozenset[int]) -> bool:
    """Whether some replica group lost no rank: it holds every tensor of the model."""
    return any(lost.isdisjoint(group.ranks) for group in mesh.replica_groups())
