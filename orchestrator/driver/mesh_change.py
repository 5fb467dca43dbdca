"""Changing the mesh: settling a generation that ends, and carrying out what the policy decides.

Runs on the driver; the controller holds one ``MeshChange``. A generation ends on a failure
(``MeshChange.begin_settling`` aborts the step in flight), a drain or a grow (it asks for a
pause at the step boundary), or a failure while it is configured (``configuration_failed``).
``MeshChange.settle`` is the ``Settling`` state's handler: once every surviving rank has left
(or is found lost), ``_decide`` asks the failure or scaling policy (``elastic/policy.py``) and
``_carry_out`` carries the decision out: shrink or refill in place, grow (``_change_mesh``:
the next generation, which the controller configures), restore or reshape (``Restore``), or fail.
"""

from __future__ import annotations

import logging
import math
import time
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
from orchestrator.driver.checkpoint_commits import CheckpointCommits
from orchestrator.driver.detector import Detector, DrainWatch, LossKind, Lost, failure_fields, stuck_ranks
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from orchestrator.driver.peer_memory import RecoveryPoint, SnapshotBook
from orchestrator.driver.polling import RankPolls
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.replicas import Replicas, replicas_of
from orchestrator.driver.restore import Restore
from orchestrator.driver.states import Configuring, Next, NextGeneration, Running, SettlePurpose, Settling, run_failed
from orchestrator.driver.transitions import TransitionKind, TransitionTimer
from orchestrator.observe.events import EventLog
from workers.faults import DriverFaults
from workers.spec.messages import RunOutcome, StartFrom, StartMode

log = logging.getLogger("meshpilot")

# After every survivor has left, how long to wait for Ray to name the cause (an actor's death
# is reported a moment after its peers see their connections close).
CAUSE_GRACE_S = 5.0
# Losses whose process may still hold the step (or a socket): killed when the generation fails.
# NODE_LOST too: an unreachable node's actors may come back with its network (a dead node's: harmless).
KILLED_ON_FAILURE = (LossKind.HANG, LossKind.UNRESPONSIVE, LossKind.NODE_LOST)


class MeshChange:
    """Settles ending generations and carries out the policies' decisions (driver side)."""

    def __init__(
        self,
        *,
        group: WorkerGroupProtocol[Slot],
        replicas: Replicas,
        detector: Detector,
        drains: DrainWatch,
        polls: RankPolls,
        router: ReportRouter,
        snapshots: SnapshotBook,
        checkpoints: CheckpointCommits,
        failure_policy: FailurePolicy,
        scaling_policy: ScalingPolicy,
        restore: Restore,
        transitions: TransitionTimer,
        faults: DriverFaults,
        events: EventLog,
        collective_timeout_s: float,
        poll_interval_s: float,
    ) -> None:
        self.group = group
        self.replicas = replicas
        self.detector = detector
        self.drains = drains
        self.polls = polls
        self.router = router
        self.snapshots = snapshots
        self.checkpoints = checkpoints
        self.failure_policy = failure_policy
        self.scaling_policy = scaling_policy
        self.restore = restore
        self.transitions = transitions
        self.faults = faults
        self.events = events
        self.collective_timeout_s = collective_timeout_s
        self.poll_interval_s = poll_interval_s

    # ------------------------------------------------------------ a generation ends
    def begin_settling(
        self,
        state: Running,
        purpose: SettlePurpose,
        *,
        lost: dict[int, Lost] | None = None,
        draining: frozenset[int] = frozenset(),
        refill: bool = True,
    ) -> Settling:
        """End the running generation (called by the controller while supervising it): on a
        failure abort the step in flight everywhere, for a drain or a grow pause at the step
        boundary. ``Settling`` waits until every surviving rank has left."""
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
            refill=refill,
        )

    def configuration_failed(self, state: Configuring) -> Settling:
        """A rank failed while a running job's new mesh was configured (called by the controller:
        a fault during a recovery, a grow or a restore): the configuring generation fails like a
        running one, and the recovery starts again from what is left. Ranks that kept their state
        still hold it; joiners and restoring ranks hold none (``stateless``), so their replica
        groups are not kept. Survivors may wait in the new groups' rendezvous for a rank that
        will never come: they are given the collective timeout to come back before counting as
        stuck (``_unwind_s``), or only the unwind allowance when the peer-memory snapshot is whole
        without them (``_held_elsewhere``)."""
        now = time.monotonic()
        log.warning("a rank failed while generation %s was configured: recovering again", state.generation)
        # The detector still knows the last running generation's ranks: this one's are judged now.
        self.detector.reset(state.mesh.world_size, self.polls.last_step)
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

    def _settle_deadline(self, purpose: SettlePurpose, now: float, *, configuring: bool = False) -> float:
        """When ranks still out of the settling generation count as stuck. A pause has no
        deadline: its ranks finish the step they are in (and a drain's save), and a hang or
        silence there is caught as while running (``settle``), by the configured timeouts."""
        return now + self._unwind_s(configuring) if purpose == SettlePurpose.FAILURE else math.inf

    def _unwind_s(self, configuring: bool) -> float:
        """How long survivors of an aborted generation may take to leave it: the hang threshold,
        at least ``UNWIND_FLOOR_S`` (``Detector.unwind_s``); while configuring, at least the
        collective timeout, since a rank inside torch's rendezvous (a peer died after the join
        barrier) cannot be interrupted."""
        threshold = self.detector.unwind_s()
        return max(threshold, self.collective_timeout_s + 5.0) if configuring else threshold

    def _request_pause(self, state: Running, purpose: SettlePurpose, draining: frozenset[int]) -> None:
        """Every rank stops after the step it is in; with every replica draining, saves first."""
        if purpose == SettlePurpose.DRAIN:
            nodes = sorted({node for rank in draining if (node := self.replicas.node_of(rank))})
            signalled = all(self.group.active[rank] in self.drains.retiring for rank in draining)
            # A signalled process, or a straggler to replace or exclude (``DrainWatch.retire``).
            reasons = {self.drains.reasons.get(self.group.active[rank], "process told to end") for rank in draining}
            retired = reasons.pop() if len(reasons) == 1 else "process told to end"
            self.events.emit(
                "drain",
                node=nodes[0] if len(nodes) == 1 else nodes,
                ranks=sorted(draining),
                reason=retired if signalled else "node draining",
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
        self.group.abort_step(state.generation, self.polls.last_step + 1, survivors)

    # ------------------------------------------------------------------ settling
    def settle(self, state: Settling) -> Next:
        """The ``Settling`` handler: wait (one poll per call) until every surviving rank has left
        the generation or is found lost, then decide and carry the decision out."""
        state.calls.collect(timeout=self.poll_interval_s, first=True)
        self.polls.take_reports()
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

    def _held_elsewhere(self, state: Settling, lost: dict[int, Lost], now: float) -> bool:
        """Whether the ranks still inside a failed configuration need not be waited for any more.

        They may sit in torch's rendezvous, out of reach of the abort, until the collective
        timeout (``_unwind_s``: minutes). Past the unwind allowance that wait saves nothing when the
        peer-memory snapshot of the step the job resumes from is whole with them counted as
        holders: as stuck ranks their actors linger and serve it, and no step is lost."""
        if not state.configuring or now < state.started_at + self.detector.unwind_s():
            return False
        memory = self._memory_without(lost, state.draining)
        return memory is not None and memory.step >= self.polls.last_step

    def _memory_without(self, lost: dict[int, Lost], draining: frozenset[int]) -> RecoveryPoint | None:
        """The newest whole peer-memory snapshot once ``lost`` and ``draining`` ranks are gone; a
        stuck rank's actor is alive and serves its snapshots to a restore before it is killed."""
        holders_leaving = (set(lost) - stuck_ranks(lost)) | draining
        return self.snapshots.recoverable(self.replicas.gone_besides(holders_leaving))

    # ------------------------------------------------------------------ deciding
    def _decide(self, state: Settling, lost: dict[int, Lost]) -> Next:
        """Every surviving rank has left: close the generation's books, ask the policy, carry out."""
        resume_step = self._close_generation(state, lost)
        if state.purpose == SettlePurpose.FAILURE and not lost:
            # Every rank left without a cause being found (all echoes): the whole generation
            # counts as lost rather than retrying blindly.
            lost = {
                rank: Lost(LossKind.RANK_ERROR, "left the generation without a cause")
                for rank in range(state.mesh.world_size)
            }
        if lost:
            self._record_losses(state, lost)
        return self._carry_out(self._policy_decision(state, lost), state, lost, resume_step)

    def _close_generation(self, state: Settling, lost: dict[int, Lost]) -> int:
        """Take the last reports of the survivors and emit every step they all applied; returns
        the step the next generation resumes after (the fewest steps any survivor applied)."""
        self.polls.take_reports(timeout=5.0)  # last reports of ranks about to leave, on a slow machine too
        survivors = {
            rank: outcome.last_step
            for rank, outcome in state.calls.results.items()
            if rank not in lost and isinstance(outcome, RunOutcome)
        }
        applied = list(survivors.values())
        resume_step = min(applied) if applied else self.polls.last_step
        self.polls.await_step_reports(resume_step, survivors)
        self.snapshots.applied(state.generation, max(applied, default=0))
        self.router.flush(resume_step)
        self.polls.last_step = max(self.polls.last_step, resume_step)
        return resume_step

    def _record_losses(self, state: Settling, lost: dict[int, Lost]) -> None:
        """The ``failure`` event, and what the losses take with them."""
        self.events.emit("failure", **failure_fields(lost))
        # Warm and starting actors on a lost node died with it: none may be picked to join.
        self.replicas.leaving({loss.node for loss in lost.values() if loss.kind == LossKind.NODE_LOST and loss.node})
        # Faults fired in this generation are consumed: a redo of the step must not fire them again.
        self.faults.consume_after_failure(self.router.last_emitted_step, configuring=state.configuring)

    def _policy_decision(self, state: Settling, lost: dict[int, Lost]) -> Decision:
        """The scaling policy's decision for a grow, the failure policy's otherwise."""
        if state.purpose == SettlePurpose.GROW:
            return self.scaling_policy.decide(
                state.mesh, warm_actors=len(self.group.warm()), fits=self.replicas.fits, reshape=self.snapshots.enabled
            )
        # Stateless ranks (a failed configuration's joiners) are healthy but cannot be kept: to
        # the policy their replica groups leave as if draining; the actors go warm.
        leaving = state.draining | (state.stateless - set(lost))
        warm = len(self.group.warm()) + self.replicas.healthy_in_hit_replicas(
            state.mesh, lost, state.draining, state.stateless
        )
        if not state.refill:
            warm = 0  # the leaving replica groups are not replaced (elastic.straggler.action=exclude)
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
        # Whatever the restore lands on is decided once actors are at hand (AwaitingActors).
        return self.failure_policy.decide(status, fits=self.replicas.fits, restore_mesh=lambda: state.mesh)

    # ------------------------------------------------------------ carrying it out
    def _carry_out(self, decision: Decision, state: Settling, lost: dict[int, Lost], resume_step: int) -> Next:
        if isinstance(decision, Fail):
            return run_failed("policy", decision.reason)
        if isinstance(decision, RestoreFromCheckpoint):
            return self.restore.begin(decision, state, lost, resume_step)
        if isinstance(decision, Reshape):
            reshaped = self.restore.reshape(state, decision.new_mesh, resume_step)
            return reshaped or self._carry_out(Continue(), state, {}, resume_step)
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
            return run_failed("policy", f"cannot carry out {decision!r}")
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
    ) -> NextGeneration:
        """The next generation in place: ``kept`` ranks rebind the slices they hold; ``joining``
        ones receive theirs from a surviving replica (every rank then syncs replicas). The old
        mesh's checkpoint uploads still in flight go on and commit without the ``lost`` ranks (a
        pause loses none) while a whole replica survived: a save the lost ranks took part in
        needs only the slices written by the survivors (copies of other replicas are not written)."""
        self.group.set_active(kept + joining)
        starts = (StartFrom(StartMode.KEPT),) * len(kept) + (StartFrom(StartMode.PEER, resume_step),) * len(joining)
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
        return NextGeneration(
            new_mesh,
            starts,
            sync_replicas=len(joining) > 0,
            stateless=frozenset(range(len(kept), len(kept) + len(joining))),
            paused_after=resume_step if _a_replica_survived(state.mesh, lost) else None,
            lost=lost,
        )


def _a_replica_survived(mesh: MeshSpec, lost: frozenset[int]) -> bool:
    """Whether some replica group lost no rank: it holds every tensor of the model."""
    return any(lost.isdisjoint(group.ranks) for group in mesh.replica_groups())
