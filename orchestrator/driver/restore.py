"""Restoring the job's state onto a mesh, from peer memory or from storage.

Runs on the driver; the controller holds one ``Restore`` and the mesh change calls it. When no
complete replica group survives, ``Restore.begin`` releases the actors and ``Restore.await_actors``
gathers enough of them; ``Restore.onto`` is the generation in which every rank loads the chosen
state resharded to the mesh: a peer-memory snapshot (``orchestrator.driver.peer_memory``) or a
committed checkpoint. ``Restore.reshape`` moves a paused job onto a mesh differing in any degree
the same way (growing back after a restore onto fewer ranks). Ranks out of device memory while
configuring (``Restore.replace_out_of_memory``) and corrupt checkpoints (``Restore.around_corruption``)
are restored around here too.
"""

from __future__ import annotations

import logging
import time

from elastic.policy import Fail, FailurePolicy, GroupStatus, RestoreFromCheckpoint, StateSource
from elastic.spec import MeshSpec
from orchestrator.driver.calls import CallFailed
from orchestrator.driver.checkpoint_commits import CheckpointCommits
from orchestrator.driver.detector import DrainWatch, LossKind, Lost, failure_fields, group_errors, stuck_ranks
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from orchestrator.driver.peer_memory import RecoveryPoint, SnapshotBook
from orchestrator.driver.polling import RankPolls
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.replicas import Replicas
from orchestrator.driver.states import (
    AwaitingActors,
    Configuring,
    Finished,
    Next,
    NextGeneration,
    RunEnd,
    SettlePurpose,
    Settling,
    State,
    run_failed,
)
from orchestrator.driver.transitions import TransitionKind, TransitionTimer
from orchestrator.observe.events import EventLog
from workers.spec.messages import StartFrom, StartMode

log = logging.getLogger("meshpilot")


class Restore:
    """Restores of the run (driver side); see the module docstring."""

    def __init__(
        self,
        *,
        group: WorkerGroupProtocol[Slot],
        replicas: Replicas,
        polls: RankPolls,
        router: ReportRouter,
        snapshots: SnapshotBook,
        checkpoints: CheckpointCommits,
        failure_policy: FailurePolicy,
        drains: DrainWatch,
        transitions: TransitionTimer,
        events: EventLog,
        start_timeout_s: float,
        poll_interval_s: float,
    ) -> None:
        self.group = group
        self.replicas = replicas
        self.polls = polls
        self.router = router
        self.snapshots = snapshots
        self.checkpoints = checkpoints
        self.failure_policy = failure_policy
        self.drains = drains
        self.transitions = transitions
        self.events = events
        self.start_timeout_s = start_timeout_s
        self.poll_interval_s = poll_interval_s
        # Checkpoint steps a rank found corrupt: never chosen again.
        self.corrupt_steps: set[int] = set()

    def onto(
        self,
        mesh: MeshSpec,
        step: int,
        *,
        from_mesh: dict | None = None,
        memory: RecoveryPoint | None = None,
        paused_after: int | None = None,
    ) -> NextGeneration:
        """The generation in which every active rank loads checkpoint ``step`` (or, with
        ``memory``, that peer-memory snapshot), resharded to ``mesh``. ``paused_after``: see
        ``NextGeneration``. Called by the controller at the start, and from the restore steps."""
        start = StartFrom(StartMode.CHECKPOINT, step)
        if memory is not None:
            source = self.snapshots.source(memory, gone=self.replicas.gone_besides())
            start = StartFrom(StartMode.MEMORY, step, memory=source)
            from_mesh = source.manifest.mesh
        return NextGeneration(
            mesh,
            (start,) * mesh.world_size,
            restoring=step,
            from_mesh=from_mesh,
            memory=memory,
            paused_after=paused_after,
        )

    def begin(self, decision: RestoreFromCheckpoint, state: Settling, lost: dict[int, Lost], resume_step: int) -> State:
        """No complete replica survived (the mesh change's decision): every healthy actor drops
        its state and waits for a restore, from peer memory (survivors keep serving their
        snapshots, and so do stuck ranks' actors until the restore has read them) or from storage."""
        step = decision.step if decision.step is not None else self.checkpoints.latest_step()
        if step is None:
            return run_failed("restore", "no committed checkpoint to restore")
        from_memory = decision.source == StateSource.PEER_MEMORY
        self.replicas.release(lost, state.draining, linger=stuck_ranks(lost) if from_memory else ())
        memory = None
        if from_memory:
            memory = self.snapshots.recoverable(self.replicas.gone_besides())
            if memory is None or memory.step != step:  # the policy saw it whole a moment ago
                return run_failed("restore", f"peer-memory snapshot of step {step} is no longer whole")
        if memory is None and state.purpose == SettlePurpose.DRAIN:
            if (preempted := self._nowhere_to_go(step)) is not None:
                return preempted
        log.warning(
            "no complete replica group survived: restoring %s step %s (%d steps to redo)",
            "checkpoint" if memory is None else "the peer-memory snapshot of",
            step,
            resume_step - step,
        )
        return AwaitingActors(
            step=step,
            mesh=state.mesh,
            began_at=state.started_at,
            deadline=time.monotonic() + self.start_timeout_s,
            lost_steps=max(0, resume_step - step),
            memory=memory,
        )

    def _nowhere_to_go(self, step: int) -> Finished | None:
        """A drain's restore from storage when every node that could hold a rank is going away:
        nothing to wait for. The drain saved first, so the run ends now with the place to resume from."""
        gone = self.drains.nowhere_to_go(self.group.avoid_nodes)
        if not gone:
            return None
        nodes = ", ".join(sorted(gone))
        log.warning("every node that can hold a rank is draining (%s): stopping at checkpoint step %s", nodes, step)
        return Finished.of(
            RunEnd.PREEMPTED,
            reason=f"every node that can hold a rank is draining ({nodes}); "
            f"checkpoint step {step} is the place to resume from",
        )

    def await_actors(self, state: AwaitingActors) -> Next:
        """The ``AwaitingActors`` handler: restore onto the largest mesh the warm actors can hold,
        starting more while they come. From peer memory, at once onto what is warm: the mesh
        grows back (``Reshape``) once the actors have started, without holding training up meanwhile."""
        warm, target = self.replicas.gather(state.mesh, start_more=state.memory is None)
        out_of_time = time.monotonic() > state.deadline
        wait_for_more = state.memory is None and self.group.starting() and not out_of_time
        if target is None or (target != state.mesh and wait_for_more):
            if out_of_time:
                return run_failed(
                    "restore",
                    "no capacity to restore the checkpoint onto within "
                    f"runtime.start_timeout_s={self.start_timeout_s:g}",
                )
            time.sleep(self.poll_interval_s)
            return state
        self.group.set_active(self.replicas.pick_warm(warm, target.world_size))
        self.transitions.begin(
            TransitionKind.RECOVERED,
            began_at=state.began_at,
            old_mesh=state.mesh,
            new_mesh=target,
            resume_step=state.step,
            lost_steps=state.lost_steps,
            cause="restore",
            source=StateSource.STORAGE if state.memory is None else StateSource.PEER_MEMORY,
        )
        self.polls.last_step = state.step  # the run goes back to the restored step
        return self.onto(target, state.step, memory=state.memory)

    def reshape(self, state: Settling, new_mesh: MeshSpec, resume_step: int) -> NextGeneration | None:
        """Every rank paused after ``resume_step`` (the mesh change's ``Reshape`` decision): move
        onto ``new_mesh`` with warm actors joining, every rank loading the boundary's peer-memory
        snapshot resharded (no storage, no step lost). None when that snapshot is not whole or
        no actor can join: the job stays on its mesh."""
        memory = self.snapshots.recoverable(self.replicas.gone_besides())
        joining = self.replicas.pick_warm(self.group.warm(), new_mesh.world_size - state.mesh.world_size)
        if memory is None or memory.step != resume_step or not joining:
            log.info("no whole peer-memory snapshot of step %s: staying on %s", resume_step, state.mesh.describe())
            return None
        kept = list(self.group.active)
        self.group.set_active(kept + joining)
        self.transitions.begin(
            TransitionKind.GROW,
            began_at=state.started_at,
            old_mesh=state.mesh,
            new_mesh=new_mesh,
            resume_step=resume_step,
            lost_steps=0,
            added_ranks=tuple(range(len(kept), len(kept) + len(joining))),
            cause=state.purpose,
            source=StateSource.PEER_MEMORY,
        )
        self.drains.clear()
        return self.onto(new_mesh, resume_step, memory=memory, paused_after=resume_step)

    def around_corruption(self, state: Configuring, step: int, corrupt: CallFailed) -> Next:
        """A rank found a checksum mismatch restoring ``step`` (called by the controller while the
        ranks configure): fall back to the previous committed step."""
        self.corrupt_steps.add(step)
        log.warning(
            "checkpoint step %s is corrupt (%s); falling back to the previous committed checkpoint",
            step,
            corrupt.message,
        )
        previous = self.checkpoints.choose_resume(skip_steps=self.corrupt_steps)
        if previous is None:
            return run_failed("restore", f"no intact checkpoint left to restore: {corrupt.message}")
        state.calls.collect(timeout=self.start_timeout_s)  # let the others finish first
        return self.onto(state.mesh, previous.step, from_mesh=previous.mesh)

    def replace_out_of_memory(self, state: Configuring, out_of_memory: dict[int, CallFailed]) -> State:
        """Ranks ran out of device memory while configuring (called by the controller): within
        the failure budget, their actors are replaced (removed; ``AwaitingActors`` starts new
        ones) and every rank restores the latest committed checkpoint. Without one the run fails,
        saying why.

        Not an in-place shrink or refill: every other rank of the generation holds a trainer
        whose state was never filled, and a retried configure with ``StartMode.KEPT`` would keep
        that trainer's slices as if they were the previous generation's.
        """
        message = group_errors({rank: f.message for rank, f in out_of_memory.items()})
        step = state.restoring if state.restoring is not None else self.checkpoints.latest_step()
        if step is None:
            return run_failed("configuration", f"out of device memory, no committed checkpoint to restore: {message}")
        lost = {
            rank: Lost(LossKind.RANK_ERROR, f.message, self.replicas.node_of(rank)) for rank, f in out_of_memory.items()
        }
        status = GroupStatus(
            mesh=state.mesh,
            lost_ranks=frozenset(lost),
            draining_ranks=frozenset(),
            warm_actors=0,
            checkpoint_step=step,
            time=time.monotonic(),
            completed_step=self.router.steps_emitted,
        )
        decision = self.failure_policy.decide(status, fits=self.replicas.fits, restore_mesh=lambda: state.mesh)
        if isinstance(decision, Fail):
            return run_failed("policy", f"{decision.reason}; last: out of device memory: {message}")
        log.warning("out of device memory while configuring (%s): new actors restore step %s", message, step)
        survivors = [rank for rank in range(state.mesh.world_size) if rank not in lost]
        self.group.abort_step(state.generation, self.polls.last_step + 1, survivors)  # frees ranks blocked on them
        state.calls.collect(timeout=self.start_timeout_s)
        self.events.emit("failure", **failure_fields(lost))
        self.replicas.release(lost, ())
        return AwaitingActors(
            step=step,
            mesh=state.mesh,
            began_at=state.started_at,
            deadline=time.monotonic() + self.start_timeout_s,
            lost_steps=max(0, self.polls.last_step - step),
        )
