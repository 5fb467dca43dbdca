"""Polling the ranks: their heartbeats to the detector, their reports to the router, the run's progress.

Runs on the driver. The controller polls once per iteration while the ranks configure, run or
leave a generation (``take_reports``); the mesh change polls again before it decides, until the
survivors' reports of every step they applied are in (``await_step_reports``). One poll is one
fan-out call to the active ranks (``WorkerGroupProtocol.poll``), answered by each rank's actor
thread while its training thread may sit in a collective.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from orchestrator.driver.calls import CallFailed
from orchestrator.driver.detector import Detector
from orchestrator.driver.group import Slot, WorkerGroupProtocol
from orchestrator.driver.rank_reports import ReportRouter
from orchestrator.driver.transitions import TransitionTimer
from workers.spec.messages import Phase


class RankPolls:
    """The driver's polls of the active ranks, and ``last_step``: the newest step the run completed.

    ``last_step`` rises with every step event; a configuration's answer sets it (the step the
    ranks resume after) and a restore rewinds it to the restored step.
    """

    def __init__(
        self,
        group: WorkerGroupProtocol[Slot],
        detector: Detector,
        router: ReportRouter,
        transitions: TransitionTimer,
        *,
        heartbeat_timeout_s: float,
    ) -> None:
        self.group = group
        self.detector = detector
        self.router = router
        self.transitions = transitions
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.last_step = 0

    def take_reports(self, timeout: float = 1.0) -> None:
        """Poll every active rank once (up to ``timeout``, never past the heartbeat timeout) and
        hand on what came back; a transition ends here once its first step is in."""
        for rank, heartbeat in self.group.poll(min(timeout, self.heartbeat_timeout_s)).items():
            if isinstance(heartbeat, CallFailed):
                continue  # a dead actor: its run call says so
            self.detector.heard(rank, heartbeat.waiting, heartbeat.where, evaluating=heartbeat.phase == Phase.EVAL)
            self.router.route(list(heartbeat.reports))
        self.last_step = max(self.last_step, self.router.last_emitted_step)
        self.detector.stepped(self.router.last_emitted_step, self.router.last_step_time_s)
        self.transitions.report()

    def await_step_reports(self, resume_step: int, survivors: Iterable[int]) -> None:
        """Poll until the survivors' reports of every step up to ``resume_step`` are in, or the
        heartbeat timeout passed. On a loaded machine a rank can answer a poll after one poll
        gave up on it; a step of the old mesh left without an event would hold back every later
        one (the router emits steps in order)."""
        deadline = time.monotonic() + self.heartbeat_timeout_s
        while not self.router.reported(resume_step, survivors) and time.monotonic() < deadline:
            self.take_reports(timeout=1.0)
