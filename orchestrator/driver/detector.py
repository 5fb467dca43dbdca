"""Turning what the driver sees into findings: which ranks are lost, which must leave, and why.

Runs on the driver, fed once per controller iteration. Sources:

* a rank's run call ended: the actor died (``rank_died``, or ``node_lost`` when its node is
  gone from Ray), or it raised an error of its own (``rank_error``; errors that merely echo
  another rank's failure, like a closed connection, do not count);
* a rank stopped answering polls for ``heartbeat_timeout_s`` (``unresponsive``);
* no step completed for ``hang_timeout_s``, and for at least ``HANG_STEP_FACTOR`` typical
  step times (``hang``): the ranks busy in the step while the others wait on them in
  collectives are the culprits. The second bound keeps a slow machine (or a large step) from
  looking hung;
* drain notices: Ray marks a node draining (autoscaler, spot reclaim, ``ray drain-node``, a
  pod's preStop hook), or a rank reports one (cloud instance-action endpoint, SIGTERM).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from workers.spec.messages import RunOutcome


@dataclass(frozen=True)
class Lost:
    """Why one rank is out: kind (rank_died, node_lost, rank_error, unresponsive, hang, stuck)."""

    kind: str
    message: str
    node: str | None = None


# A step is hung only once it has taken this many times the recent median step time.
HANG_STEP_FACTOR = 5.0


class Detector:
    def __init__(self, *, heartbeat_timeout_s: float, hang_timeout_s: float,
                 clock=time.monotonic) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.clock = clock
        # Kept across generations: the first step of a new mesh is judged by the old ones.
        self.step_times: deque[float] = deque(maxlen=20)
        self.reset(0)

    def reset(self, world_size: int, step: int = 0) -> None:
        """A new generation: every rank counts as just heard from, progress as just made."""
        now = self.clock()
        self.last_heard = {rank: now for rank in range(world_size)}
        self.progress = (step, now)
        self.waiting: dict[int, bool | None] = {}
        self.where: dict[int, str | None] = {}

    # --------------------------------------------------------------- inputs
    def heard(self, rank: int, waiting: bool | None, where: str | None) -> None:
        self.last_heard[rank] = self.clock()
        self.waiting[rank] = waiting
        self.where[rank] = where

    def stepped(self, step: int, step_time_s: float | None = None) -> None:
        if step > self.progress[0]:
            self.progress = (step, self.clock())
            if step_time_s:
                self.step_times.append(step_time_s)

    def hang_threshold_s(self) -> float:
        typical = statistics.median(self.step_times) if self.step_times else 0.0
        return max(self.hang_timeout_s, HANG_STEP_FACTOR * typical)

    # -------------------------------------------------------------- findings
    @staticmethod
    def from_outcome(outcome: RunOutcome | Any, node_alive: bool, node: str | None) -> Lost | None:
        """The loss a finished run call reveals, or None (finished, paused, a survivor's echo)."""
        status = getattr(outcome, "status", None)
        if status == "died":
            if not node_alive:
                return Lost("node_lost", f"node {node} left the cluster", node)
            return Lost("rank_died", outcome.error or "the rank's process died", node)
        if status == "failed" and not outcome.caused_by_peer:
            return Lost("rank_error", outcome.error or "the rank raised", node)
        return None

    def unresponsive(self) -> list[int]:
        now = self.clock()
        return sorted(rank for rank, heard in self.last_heard.items() if now - heard > self.heartbeat_timeout_s)

    def heartbeat_ages(self) -> dict[str, float]:
        now = self.clock()
        return {str(rank): round(now - heard, 3) for rank, heard in sorted(self.last_heard.items())}

    def hung(self) -> list[int] | None:
        """Ranks to blame for a hang, once no step completed for ``hang_threshold_s``; else None.

        Blame the ranks busy inside the step while others wait on them; if every rank waits
        (mismatched collectives) or every rank is busy, blame them all.
        """
        if self.clock() - self.progress[1] <= self.hang_threshold_s():
            return None
        busy = sorted(rank for rank, waiting in self.waiting.items() if waiting is False)
        waiting = [rank for rank, w in self.waiting.items() if w]
        if busy and waiting:
            return busy
        return sorted(self.last_heard)

    def stalled_for(self) -> float:
        return self.clock() - self.progress[1]
