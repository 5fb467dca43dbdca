"""Timing a change of mesh: from its start to the first step completed on the new mesh.

Runs on the driver. The controller starts a ``Transition`` when it carries out a recovery, a
restore or a grow; ``TransitionTimer.report`` is called after every batch of step reports and
emits the ``recovered`` event (``mttr_s``, ``lost_steps``, ``cause``, ``source``) or the
``grow`` event (``join_s``, ``source``) once, when the first step after ``resume_step`` has completed everywhere. Times
are the ranks' wall clocks, so they include the last step's run, not the driver's poll delay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum

from elastic.policy import StateSource
from elastic.spec import MeshSpec
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.observe.events import EventLog


class TransitionKind(StrEnum):
    """The event a transition ends with."""

    RECOVERED = "recovered"  # a shrink, a refill or a restore after a failure or a drain
    GROW = "grow"


@dataclass(frozen=True)
class Transition:
    """A change of mesh in flight; reported once the first step on the new mesh completes."""

    kind: TransitionKind
    began_at: float  # monotonic: the fault's detection, or the pause request
    began_wall: float
    old_mesh: MeshSpec
    new_mesh: MeshSpec
    resume_step: int
    lost_steps: int = 0
    added_ranks: tuple[int, ...] = ()
    cause: str = "failure"  # a SettlePurpose, or "restore"
    # Where ranks that did not hold the state took it from.
    source: StateSource = StateSource.REPLICA
    # The router's count of step events when it began: only a step completed since ends it.
    steps_emitted: int = 0


def wall_time_of(monotonic_time: float) -> float:
    """The wall-clock time of an earlier ``time.monotonic()`` reading (the ranks report wall time)."""
    return time.time() - (time.monotonic() - monotonic_time)


class TransitionTimer:
    """The transition in flight, if any, and its report (driver side)."""

    def __init__(self, events: EventLog, router: ReportRouter) -> None:
        self.events = events
        self.router = router
        self.pending: Transition | None = None

    def begin(
        self,
        kind: TransitionKind,
        *,
        began_at: float,
        old_mesh: MeshSpec,
        new_mesh: MeshSpec,
        resume_step: int,
        lost_steps: int,
        cause: str,
        added_ranks: tuple[int, ...] = (),
        source: StateSource = StateSource.REPLICA,
    ) -> None:
        """A change of mesh that began at monotonic time ``began_at`` resumes after ``resume_step``."""
        self.pending = Transition(
            kind=kind,
            began_at=began_at,
            began_wall=wall_time_of(began_at),
            old_mesh=old_mesh,
            new_mesh=new_mesh,
            resume_step=resume_step,
            lost_steps=lost_steps,
            added_ranks=added_ranks,
            cause=cause,
            steps_emitted=self.router.steps_emitted,
            source=source,
        )

    def report(self) -> None:
        """Emit the pending transition's event once a step after its resume step completed on
        the new mesh. (Before a restore's configuration rewinds the router, the steps it will
        redo are still counted as done: they do not end the transition.)"""
        transition = self.pending
        if (
            transition is None
            or self.router.last_emitted_step <= transition.resume_step
            or self.router.steps_emitted <= transition.steps_emitted
        ):
            return
        completed_at = self.router.completed_at.get(transition.resume_step + 1, time.time())
        elapsed = round(completed_at - transition.began_wall, 3)
        if transition.kind == TransitionKind.GROW:
            self.events.emit(
                "grow",
                new_mesh=transition.new_mesh.as_dict(),
                added_ranks=list(transition.added_ranks),
                join_s=elapsed,
                old_mesh=transition.old_mesh.as_dict(),
                source=transition.source,
            )
        else:
            self.events.emit(
                "recovered",
                mttr_s=elapsed,
                lost_steps=transition.lost_steps,
                old_mesh=transition.old_mesh.as_dict(),
                new_mesh=transition.new_mesh.as_dict(),
                cause=transition.cause,
                refilled_ranks=list(transition.added_ranks),
                source=transition.source,
            )
        self.pending = None
