"""How often peer-memory snapshots are taken: as often as asked, unless that costs too much.

Pure (no ray, no torch); the driver's snapshot book (``orchestrator/driver/peer_memory.py``)
feeds it the ranks' measurements and carries out the interval it returns.

A snapshot costs a rank what its loop thread waits for it: starting it after the step it
snapshots (a stall, normally only queueing the copies), and the wait, before the next step's
optimizer step, for the copy to host memory and to the buddy that ran beside that step's
forward and backward (``workers/peer_snapshots.py``). That exposed cost is near zero while the
copies take less than a step's compute; a state too large to copy within a step shows it. Each
rank reports it in units of its own step time (``cost_steps``); a step is as slow as its
slowest rank, so a snapshot's cost is the largest any rank reported for it. The cadence uses the
median of the ``WINDOW`` snapshots before the newest (whose reports may still be coming in; the
first one also allocates its buffers). Taking a snapshot every ``k`` steps then costs
``cost_steps / k`` of the step time; the interval is the smallest ``k`` at or above the
configured one that keeps this under ``overhead_limit``. It comes back down only once the
smaller interval would keep the overhead under ``LOWER_MARGIN`` of the limit, so a cost near
the limit does not make it flip at every snapshot.

The interval is an agreement, not a rank's choice: a restore needs every rank's snapshot of the
same step. The driver publishes it in the job's store and the commit vote decides, for every
rank at once, whether a step is snapshotted (``workers/rendezvous.py``).
"""

from __future__ import annotations

import math
from statistics import median

# Snapshots whose cost the cadence looks at: enough to ignore one slow copy, few enough to follow
# a change of step time (a new mesh, a longer sequence) within a handful of snapshots.
WINDOW = 5
# The widest interval chosen: past it a restore from memory could rewind more steps than the
# snapshots would ever save (a checkpoint interval is usually of this order or less).
MAX_INTERVAL = 100
# A smaller interval is taken only when it keeps the overhead within this fraction of the limit.
LOWER_MARGIN = 0.8


class SnapshotCadence:
    """The current snapshot interval of a job, from the configured one and the measured costs."""

    def __init__(self, interval_steps: int, overhead_limit: float) -> None:
        """``interval_steps``: the configured interval (0: snapshots off); ``overhead_limit``:
        the fraction of step time snapshots may cost (0: no limit, the interval never changes)."""
        self.configured = interval_steps
        self.overhead_limit = overhead_limit
        self.interval = interval_steps
        self._costs: dict[int, float] = {}  # step -> largest cost_steps any rank reported
        # The cost per snapshot (in steps) the interval was last judged on: why it changed.
        self.measured_cost: float | None = None

    @property
    def adaptive(self) -> bool:
        return self.configured > 0 and self.overhead_limit > 0

    def observe(self, step: int, cost_steps: float) -> int | None:
        """One rank's cost of its snapshot of ``step``; returns the new interval when it changes."""
        if not self.adaptive or not math.isfinite(cost_steps) or cost_steps < 0:
            return None
        self._costs[step] = max(self._costs.get(step, 0.0), cost_steps)
        steps = sorted(self._costs)
        for old in steps[: -(WINDOW + 1)]:
            del self._costs[old]
        if len(steps) < 2:
            return None  # the newest snapshot's reports may still be coming in
        cost = self.measured_cost = median(self._costs[done] for done in steps[-(WINDOW + 1) : -1])
        wanted = self.interval_for(cost)
        if wanted < self.interval:
            wanted = min(self.interval, self.interval_for(cost, limit=LOWER_MARGIN * self.overhead_limit))
        if wanted == self.interval:
            return None
        self.interval = wanted
        return wanted

    def interval_for(self, cost_steps: float, *, limit: float | None = None) -> int:
        """The smallest interval at or above the configured one whose overhead stays within
        ``limit`` (default: ``overhead_limit``)."""
        needed = math.ceil(cost_steps / (limit or self.overhead_limit) - 1e-9)
        return max(self.configured, min(MAX_INTERVAL, needed))
