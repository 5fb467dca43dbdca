"""Finding stragglers in the ranks' step reports, and telling the controller which ranks must leave.

Runs on the driver. The report router hands ``StragglerWatch.on_step`` every step all ranks
reported (``RouterHooks.step_reports``); the pure ``StragglerPolicy`` (``elastic/straggler.py``)
judges each rank's compute phase against its peers'. The controller's housekeeping asks
``take`` for what to do with the stragglers found since (``StragglerMove``): the watch chooses
the action the job can afford now (``choose_action``), emits one ``straggler`` event per rank
(rank, node, factor, action, and why it was downgraded to a warning), marks a replaced or
excluded rank's node suspect, and returns the ranks whose replica groups leave at the next step
boundary, which the controller hands to the drain machinery (a pause, then a shrink, refilled
from warm actors for ``replace``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from elastic.spec import MeshSpec
from elastic.straggler import Straggler, StragglerAction, StragglerPolicy, choose_action
from orchestrator.config import StragglerConfig
from orchestrator.observe.events import EventLog
from workers.spec.messages import StepReport

log = logging.getLogger("meshpilot")

# The step phase that excludes waiting on peers: forward and backward (see Trainer.train_step).
COMPUTE_PHASE = "compute_s"


@dataclass(frozen=True)
class StragglerMove:
    """Ranks whose replica groups leave at the next step boundary; ``refill``: from warm actors."""

    ranks: frozenset[int]
    refill: bool


class StragglerWatch:
    """The current generation's straggler findings (driver side)."""

    def __init__(
        self,
        config: StragglerConfig,
        events: EventLog,
        *,
        node_of: Callable[[int], str | None],
        suspect: Callable[[str], None],
        min_replicas: int,
    ) -> None:
        """``suspect(node)`` marks the node of a replaced or excluded straggler (the worker group
        avoids it for new actors while other nodes have room)."""
        self.action = StragglerAction(config.action)
        self.policy = StragglerPolicy(factor=config.factor, window_steps=config.window_steps)
        self.events = events
        self.node_of = node_of
        self.min_replicas = min_replicas
        self.mesh: MeshSpec | None = None
        self.suspect = suspect
        self.found: list[Straggler] = []

    def reset(self, mesh: MeshSpec) -> None:
        """A new generation on ``mesh``: its ranks are judged afresh."""
        self.mesh = mesh
        self.policy.reset()
        self.found = []

    def on_step(self, step: int, reports: Mapping[int, StepReport]) -> None:
        """Every rank of the mesh reported ``step`` (called by the report router)."""
        if self.mesh is None:
            return
        compute = {
            rank: report.phases[COMPUTE_PHASE]
            for rank, report in reports.items()
            if report.phases and COMPUTE_PHASE in report.phases
        }
        self.found.extend(self.policy.observe(step, compute, self.mesh))

    def take(self, mesh: MeshSpec, *, warm_actors: int, ending: bool = False) -> StragglerMove | None:
        """The stragglers found since the last call: report each, and return the ranks that leave
        (None when none does). Called by the controller's housekeeping while the mesh runs, and
        as the run ends (``ending``: nothing is left to move, they are reported only)."""
        if not self.found:
            return None
        found, self.found = self.found, []
        ranks = frozenset(straggler.rank for straggler in found)
        if ending and self.action != StragglerAction.WARN:
            action, why = StragglerAction.WARN, "the run ended first"
        else:
            action, why = choose_action(
                self.action, mesh, ranks, warm_actors=warm_actors, min_replicas=self.min_replicas
            )
        for straggler in found:
            node = self.node_of(straggler.rank)
            if action != StragglerAction.WARN and node:
                self.suspect(node)
            log.warning(
                "rank %s (node %s) is a straggler: its compute took %.2fx its peers' median for %d steps up to "
                "step %d: %s%s",
                straggler.rank,
                node,
                straggler.factor,
                self.policy.window_steps,
                straggler.step,
                action,
                f" ({why})" if why else "",
            )
            self.events.emit(
                "straggler",
                rank=straggler.rank,
                node=node,
                factor=straggler.factor,
                step=straggler.step,
                window_steps=self.policy.window_steps,
                action=str(action),
                **({"reason": why} if why else {}),
            )
        if action == StragglerAction.WARN:
            return None
        return StragglerMove(ranks=ranks, refill=action == StragglerAction.REPLACE)
