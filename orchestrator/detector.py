"""Turning what the driver sees into findings: which ranks are lost, which must leave, and why.

Runs on the driver, fed once per controller iteration. Sources:

* a rank's run call ended: the actor died (``rank_died``, or ``node_lost`` when its node is
  gone from Ray), or it raised an error of its own (``rank_error``; errors that merely echo
  another rank's failure, like a closed connection, do not count);
* a rank stopped answering polls for ``heartbeat_timeout_s`` (``unresponsive``);
* no step completed for ``hang_timeout_s`` (``hang``): the ranks busy in the step while the
  others wait on them in collectives are the culprits;
* drain notices: Ray marks a node draining (autoscaler, spot reclaim, ``ray drain-node``, a
  pod's preStop hook), or a rank reports one (cloud instance-action endpoint, SIGTERM).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from workers.actor import RunOutcome


@dataclass(frozen=True)
class Lost:
    """Why one rank is out: kind (rank_died, node_lost, rank_error, unresponsive, hang, stuck)."""

    kind: str
    message: str
    node: str | None = None


class Detector:
    def __init__(self, *, heartbeat_timeout_s: float, hang_timeout_s: float,
                 clock=time.monotonic) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.clock = clock
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

    def stepped(self, step: int) -> None:
        if step > self.progress[0]:
            self.progress = (step, self.clock())

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
        """Ranks to blame for a hang, once no step completed for hang_timeout_s; else None.

        Blame the ranks busy inside the step while others wait on them; if every rank waits
        (mismatched collectives) or every rank is busy, blame them all.
        """
        if self.clock() - self.progress[1] <= self.hang_timeout_s:
            return None
        busy = sorted(rank for rank, waiting in self.waiting.items() if waiting is False)
        waiting = [rank for rank, w in self.waiting.items() if w]
        if busy and waiting:
            return busy
        return sorted(self.last_heard)

    def stalled_for(self) -> float:
        return self.clock() - self.progress[1]
