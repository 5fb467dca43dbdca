"""Stragglers: a rank whose compute is persistently slower than its peers', and what to do about it.

Pure decisions (no ray, no torch), fed by the driver once per completed step with each rank's
compute-phase seconds (``StepReport.phases["compute_s"]``: forward and backward, without the
clip's and the commit vote's waits on peers, where a slow rank's slowness shows up as everyone
else's wait). A rank is judged against its peers: the ranks doing the same work, those of the
same pipeline stage (different stages compute different layers). A rank whose compute time is
over ``factor`` x the median of its peers' over ``window_steps`` consecutive steps is a straggler,
found once per generation. "Over the window": every ratio of the window but its lowest (with a
window of 3 steps or more) is over the factor. A healthy rank's hiccup of a few steps is not
enough, and one noisy step of a loaded machine (a peer's spike) cannot hide a persistently slow
rank, as a rule that every step exceed the factor would let it (measured on the shared 2-core
machine: found 5 steps late).

``StragglerPolicy.observe`` finds them; ``choose_action`` says what the driver can do with one
now (``StragglerAction``): move its replica group's work to warm actors at the next step
boundary (``replace``, 0 steps lost, like a drain), shrink away from it (``exclude``), or only
report it (``warn``). Without another replica group to carry on, or without warm actors for a
replacement, a replace or exclude is reported only, with the reason.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from elastic.spec import MeshSpec


class StragglerAction(StrEnum):
    """What the driver does with a straggler (``elastic.straggler.action``)."""

    WARN = "warn"  # report it only
    REPLACE = "replace"  # its replica group's work moves to warm actors at the next step boundary
    EXCLUDE = "exclude"  # its replica group leaves at the next step boundary, no refill


@dataclass(frozen=True)
class Straggler:
    """A rank found slow: its compute time over its peers' median (the window's median ratio)."""

    rank: int
    factor: float  # the median ratio of the window
    step: int  # the step that completed the window


class StragglerPolicy:
    """Per rank of the current generation, its last ``window_steps`` compute ratios."""

    def __init__(self, *, factor: float, window_steps: int) -> None:
        self.factor = factor
        self.window_steps = window_steps
        self.reset()

    def reset(self) -> None:
        """A new generation: ranks are renumbered, every count starts again."""
        self.windows: dict[int, deque[float]] = {}
        self.found: set[int] = set()
        self.last_step: int | None = None

    def observe(self, step: int, compute_s: Mapping[int, float], mesh: MeshSpec) -> list[Straggler]:
        """One completed step's compute seconds by rank; returns the ranks found slow with it."""
        if self.last_step is not None and step != self.last_step + 1:
            self.windows = {}  # steps were skipped (a rewind, a redo): consecutive means consecutive
        self.last_step = step
        ratios = self._ratios(compute_s, mesh)
        found = []
        for rank in sorted(compute_s):
            ratio = ratios.get(rank)
            if ratio is None:
                self.windows.pop(rank, None)
                continue
            window = self.windows.setdefault(rank, deque(maxlen=self.window_steps))
            window.append(ratio)
            if len(window) == self.window_steps and self._slow(window) and rank not in self.found:
                self.found.add(rank)
                found.append(Straggler(rank=rank, factor=round(statistics.median(window), 2), step=step))
        return found

    def _slow(self, window: deque[float]) -> bool:
        """Every ratio of a full window over the factor, but its lowest one (windows of 3 or more)."""
        ordered = sorted(window)
        tolerated = 1 if len(ordered) >= 3 else 0
        return ordered[tolerated] > self.factor

    @staticmethod
    def _ratios(compute_s: Mapping[int, float], mesh: MeshSpec) -> dict[int, float]:
        """Each rank's compute time over the median of its peers' (same pipeline stage); ranks
        without peers, or whose peers took no measurable time, are not judged."""
        by_stage: dict[int, dict[int, float]] = {}
        for rank, seconds in compute_s.items():
            if 0 <= rank < mesh.world_size:
                by_stage.setdefault(mesh.coords(rank).pp, {})[rank] = seconds
        ratios = {}
        for stage in by_stage.values():
            for rank, seconds in stage.items():
                peers = [other for peer, other in stage.items() if peer != rank]
                typical = statistics.median(peers) if peers else 0.0
                if typical > 0:
                    ratios[rank] = seconds / typical
        return ratios


def choose_action(
    configured: StragglerAction, mesh: MeshSpec, ranks: frozenset[int], *, warm_actors: int, min_replicas: int
) -> tuple[StragglerAction, str]:
    """What the driver can do now with stragglers ``ranks`` of ``mesh``, and why when it is less
    than ``configured``. Their replica groups leave whole; the others must carry on."""
    if configured == StragglerAction.WARN:
        return StragglerAction.WARN, ""
    hit = len({mesh.replica_of(rank) for rank in ranks})
    remaining = mesh.dp_replicate - hit
    if remaining < 1:
        return StragglerAction.WARN, "no other replica group carries on without it"
    if configured == StragglerAction.REPLACE:
        needed = hit * mesh.replica_size
        # The stragglers' healthy replica-mates go warm as their groups leave: they count.
        available = warm_actors + needed - len(ranks)
        if available < needed:
            return StragglerAction.WARN, f"too few warm actors to replace it ({available} of {needed})"
        return StragglerAction.REPLACE, ""
    if remaining < min_replicas:
        return StragglerAction.WARN, f"excluding it would leave fewer than elastic.min_replicas={min_replicas}"
    return StragglerAction.EXCLUDE, ""
