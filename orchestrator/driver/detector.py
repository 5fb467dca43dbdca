"""Turning what the driver sees into findings: which ranks are lost, which must leave, and why.

Runs on the driver, fed once per controller iteration; the controller asks it for findings and
acts on them. It never calls Ray itself: where a finding depends on the cluster, the
controller hands it small callables (the node of a rank, the dead nodes among the active
ones), so it is tested with plain values. Sources, each a ``LossKind``:

* a rank's run call ended: the actor died (``rank_died``, or ``node_lost`` when its node is
  gone from Ray), or it raised an error of its own (``rank_error``; errors that merely echo
  another rank's failure, like a closed connection, do not count);
* a rank stopped answering polls for ``heartbeat_timeout_s`` (``unresponsive``);
* a rank answered no poll for ``UNREACHABLE_SILENT_S`` and its node accepts no TCP connection
  either (``node_lost``: a partitioned node, or one whose network died; Ray takes its health
  checks' many seconds to say so, and its actors may come back when the network does: the
  controller kills them and fences them by generation);
* no step (nor evaluation) completed for the job's own pace (``hang``): ``HANG_STEP_FACTOR`` x the
  ``HANG_PERCENTILE`` of the recent step times and ``LATEST_STEP_FACTOR`` x the slowest of the
  last few, never less than ``hang_timeout_s`` (a floor). The
  first step of each generation (warm-up, a mesh's first collectives, compilation) has its own,
  generous allowance (``Detector.hang_threshold_s``). The ranks busy in the step while the others
  wait on them in collectives are the culprits;
* while a generation fails, a rank that answers no poll for ``SILENT_GRACE_S`` on a node Ray
  reports gone (``node_lost``: Ray may take seconds more to report its actors), or that does
  not leave the generation before the settling deadline (``stuck``); a silent rank on a live
  node is ``unresponsive`` after ``heartbeat_timeout_s``, as while running (on a busy machine a
  healthy rank's answer can be late, and a short fixed grace killed such ranks).

Drain notices are not losses: Ray marks a node draining (autoscaler, spot reclaim,
``ray drain-node``, a pod's preStop hook), or a rank reports a cloud notice or SIGTERM;
``DrainWatch`` keeps both, and the controller pauses the generation at a step boundary. ``group_errors`` and
``failure_fields`` say what was found, for the ``failure`` event and the run's reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from orchestrator.driver.calls import CallFailed, CallFailedKind
from workers.spec.messages import FailureKind, RunOutcome, RunStatus

log = logging.getLogger("meshpilot")

# The node id of a rank's actor (None when not known yet).
NodeOf = Callable[[int], str | None]
# Which nodes of the active ranks Ray reports dead (one GCS call: asked only when needed).
DeadNodes = Callable[[], set[str]]
# Which of these nodes do not answer on the network now (a connection attempt each: asked only when needed).
UnreachableNodes = Callable[[set[str]], set[str]]


class LossKind(StrEnum):
    """Why a rank is out; written as the ``failure`` event's ``kind``."""

    RANK_DIED = "rank_died"  # its process died
    NODE_LOST = "node_lost"  # its node left the cluster
    RANK_ERROR = "rank_error"  # it raised an error of its own
    UNRESPONSIVE = "unresponsive"  # it answered no poll in time
    HANG = "hang"  # it was busy in a step that stopped making progress
    STUCK = "stuck"  # it did not leave a failing or pausing generation in time


@dataclass(frozen=True)
class Lost:
    """Why one rank is out, in a line (or a traceback), and on which node when known."""

    kind: LossKind
    message: str
    node: str | None = None


# A step is hung once it has taken HANG_STEP_FACTOR x the HANG_PERCENTILE of the recent step times
# (and at least elastic.hang_timeout_s). The 90th percentile of the last 20 steps is the slowest
# normal step but for the worst two (a loaded machine's spikes are in it, a one-off outlier is
# not); 4x that leaves a 2x margin over the slowest normal step seen on the shared 2-core CPU
# test machine (steps vary up to ~2x there), and still finds a 0.7 s step's hang in ~3 s.
HANG_STEP_FACTOR = 4.0
HANG_PERCENTILE = 0.9
RECENT_STEPS = 20
# ... and at least LATEST_STEP_FACTOR x the slowest of the LATEST_STEPS last steps (a generation's
# first included): when the pace changes at once (a slow link, replacement actors starting on the
# same cores, the first steps after a mesh change) the percentile lags for many steps, and in the
# chaos soak a 2 s floor over 0.2 s steps then took 3 s steps for hangs and restored for nothing.
LATEST_STEP_FACTOR = 2.0
LATEST_STEPS = 3
# The first step of a generation warms up (the mesh's first collectives connect, allocators and
# caches fill, it may compile): it may take WARMUP_STEP_FACTOR x the percentile, at least
# WARMUP_FLOOR_S; the run's very first step, with no pace known yet, FIRST_STEP_ALLOWANCE_S
# (the hang floor this detector had before it followed the job's pace).
WARMUP_STEP_FACTOR = 10.0
WARMUP_FLOOR_S = 10.0
FIRST_STEP_ALLOWANCE_S = 60.0
# How long survivors of an aborted generation get to leave it: the hang threshold, at least this
# (a rank checks its collectives were released CHECK_AFTER_S=4 s after an abort, workers/group_abort.py).
UNWIND_FLOOR_S = 10.0
# While a generation fails, a rank on a node Ray reports gone that answers no poll for this long is lost.
SILENT_GRACE_S = 3.0
# A rank silent this long has its node's reachability checked: a few missed polls (every 0.25 s).
# The check, not this delay, tells a partition from a loaded machine, whose kernel still answers.
UNREACHABLE_SILENT_S = 1.0


class Detector:
    """Heartbeats and step progress of the current generation, and the losses they reveal."""

    def __init__(
        self,
        *,
        heartbeat_timeout_s: float,
        hang_timeout_s: float,
        first_step_timeout_s: float = 0.0,
        node_of: NodeOf = lambda rank: None,
        dead_nodes: DeadNodes = set,
        unreachable_nodes: UnreachableNodes = lambda nodes: set(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hang_timeout_s = hang_timeout_s
        # The first step of a generation may take this long (a compiling job's first step compiles).
        self.first_step_timeout_s = first_step_timeout_s
        self.node_of = node_of
        self.dead_nodes = dead_nodes
        self.unreachable_nodes = unreachable_nodes
        self.clock = clock
        # Kept across generations: the first step of a new mesh is judged by the old ones. A
        # generation's first step is not kept (its warm-up would inflate the pace for 20 steps).
        self.step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self.latest_step_times: deque[float] = deque(maxlen=LATEST_STEPS)
        self.reset(0)

    def reset(self, world_size: int, step: int = 0) -> None:
        """A new generation: every rank counts as just heard from, progress as just made."""
        now = self.clock()
        self.last_heard = {rank: now for rank in range(world_size)}
        self.progress = (step, now)
        self.first_step = step + 1
        self.waiting: dict[int, bool | None] = {}
        self.where: dict[int, str | None] = {}
        self.evaluating: set[int] = set()  # ranks heard evaluating at a step boundary

    # --------------------------------------------------------------- inputs
    def heard(self, rank: int, waiting: bool | None, where: str | None, *, evaluating: bool = False) -> None:
        self.last_heard[rank] = self.clock()
        self.waiting[rank] = waiting
        self.where[rank] = where
        if evaluating:
            self.evaluating.add(rank)
        else:
            self.evaluating.discard(rank)

    def stepped(self, step: int, step_time_s: float | None = None) -> None:
        if step > self.progress[0]:
            warming_up = self.progress[0] < self.first_step
            self.progress = (step, self.clock())
            if step_time_s and not warming_up:
                self.step_times.append(step_time_s)
            if step_time_s:
                self.latest_step_times.append(step_time_s)

    def evaluated(self) -> None:
        """An evaluation ended: the ranks made progress though no step completed, so the next step
        is judged from now (an evaluation itself must end within the hang threshold, like a step)."""
        self.progress = (self.progress[0], self.clock())

    def pace_s(self) -> float | None:
        """The ``HANG_PERCENTILE`` of the recent step times (None before any step beyond a
        generation's first completed)."""
        if not self.step_times:
            return None
        ordered = sorted(self.step_times)
        return ordered[max(0, math.ceil(HANG_PERCENTILE * len(ordered)) - 1)]

    def hang_threshold_s(self) -> float:
        """How long the step under way may go without completing before it is a hang: the job's
        pace (``HANG_STEP_FACTOR`` x ``pace_s``, ``LATEST_STEP_FACTOR`` x the slowest of the last
        ``LATEST_STEPS``), never under ``hang_timeout_s``; the first step of
        a generation and an evaluation get the warm-up allowance (and a compiling job's
        ``first_step_timeout_s``)."""
        pace = self.pace_s()
        threshold = self._paced_threshold_s()
        # The generation's first step is under way, or an evaluation (eval.batches forward passes,
        # however many: not paced by the steps).
        if self.progress[0] < self.first_step or self.evaluating:
            warm_up = WARMUP_STEP_FACTOR * pace if pace is not None else FIRST_STEP_ALLOWANCE_S
            return max(threshold, self.first_step_timeout_s, WARMUP_FLOOR_S, warm_up)
        return threshold

    def _paced_threshold_s(self) -> float:
        latest = max(self.latest_step_times, default=0.0)
        return max(self.hang_timeout_s, HANG_STEP_FACTOR * (self.pace_s() or 0.0), LATEST_STEP_FACTOR * latest)

    def unwind_s(self) -> float:
        """How long the survivors of an aborted generation may take to leave it: the paced hang
        threshold (no warm-up allowance: leaving runs no step), at least ``UNWIND_FLOOR_S``."""
        return max(self._paced_threshold_s(), UNWIND_FLOOR_S)

    # -------------------------------------------------------------- findings
    def unresponsive(self) -> list[int]:
        now = self.clock()
        return sorted(rank for rank, heard in self.last_heard.items() if now - heard > self.heartbeat_timeout_s)

    def heartbeat_ages(self) -> dict[str, float]:
        now = self.clock()
        return {str(rank): round(now - heard, 3) for rank, heard in sorted(self.last_heard.items())}

    def hung(self) -> list[int] | None:
        """Ranks to blame for a hang, once no step completed for ``hang_threshold_s``; else None.

        Blame the ranks busy inside the step while others wait on them; if every rank waits
        (mismatched collectives) or every rank is busy, blame them all. Ranks heard outside a
        step (saving a checkpoint, returned from a pause) are not stalled steps: when every
        rank heard is outside one, nothing hangs.
        """
        if self.clock() - self.progress[1] <= self.hang_threshold_s():
            return None
        if self.waiting and all(waiting is None for waiting in self.waiting.values()):
            return None
        busy = sorted(rank for rank, waiting in self.waiting.items() if waiting is False)
        waiting = [rank for rank, w in self.waiting.items() if w]
        if busy and waiting:
            return busy
        return sorted(self.last_heard)

    def stalled_for(self) -> float:
        return self.clock() - self.progress[1]

    # ---------------------------------------------------------------- losses
    def losses(self, results: Mapping[int, Any], *, hangs: bool) -> dict[int, Lost]:
        """Every loss found now: in the returned run calls (``results`` by rank) first, then
        silence, then (with ``hangs``: while the generation runs) a hang."""
        findings = [self.returned_losses(results), self.unreachable_losses(results), self.unresponsive_losses(results)]
        if hangs:
            findings.append(self.hang_losses())
        return first_found(*findings)

    @staticmethod
    def loss_of(result: RunOutcome | CallFailed | int, node: str | None, node_alive: bool) -> Lost | None:
        """The loss a returned run call reveals, or None (finished, paused, a survivor's echo)."""
        if isinstance(result, CallFailed):
            if result.failure_kind == FailureKind.PEER_FAILURE:
                return None  # an echo: the rank's peer failed (the rank said so)
            if result.kind != CallFailedKind.DIED:
                return Lost(LossKind.RANK_ERROR, result.message or "the rank raised", node)
            if not node_alive:
                return Lost(LossKind.NODE_LOST, f"node {node} left the cluster", node)
            return Lost(LossKind.RANK_DIED, result.message or "the rank's process died", node)
        if not isinstance(result, RunOutcome):
            return None  # a configuration that returned its step
        if result.status == RunStatus.FAILED and not result.caused_by_peer:
            return Lost(LossKind.RANK_ERROR, result.error or "the rank raised", node)
        return None

    def returned_losses(self, results: Mapping[int, Any]) -> dict[int, Lost]:
        """Losses among the run calls that returned (``results`` by rank)."""
        died = any(isinstance(r, CallFailed) and r.kind == CallFailedKind.DIED for r in results.values())
        dead = self.dead_nodes() if died else set()
        found = {}
        for rank, result in results.items():
            node = self.node_of(rank)
            loss = self.loss_of(result, node, node not in dead)
            if loss is not None:
                found[rank] = loss
        return found

    def unresponsive_losses(self, returned: Container[int]) -> dict[int, Lost]:
        """Ranks whose run call has not returned and that answered no poll in time."""
        return {
            rank: Lost(
                LossKind.UNRESPONSIVE,
                f"no heartbeat for more than elastic.heartbeat_timeout_s={self.heartbeat_timeout_s:g}",
            )
            for rank in self.unresponsive()
            if rank not in returned
        }

    def unreachable_losses(self, returned: Container[int]) -> dict[int, Lost]:
        """Ranks whose run call has not returned, silent for ``UNREACHABLE_SILENT_S``, on a node
        that does not answer on the network (``unreachable_nodes``): lost with their node."""
        now = self.clock()
        silent = {
            rank: node
            for rank, heard in self.last_heard.items()
            if rank not in returned and now - heard > UNREACHABLE_SILENT_S and (node := self.node_of(rank))
        }
        if not silent:
            return {}
        unreachable = self.unreachable_nodes(set(silent.values()))
        return {
            rank: Lost(LossKind.NODE_LOST, f"node {node} stopped answering on the network", node)
            for rank, node in silent.items()
            if node in unreachable
        }

    def hang_losses(self) -> dict[int, Lost]:
        """The ranks to blame once the running generation stopped making progress (see ``hung``)."""
        culprits = self.hung()
        if culprits is None:
            return {}
        stalled = self.stalled_for()
        return {
            rank: Lost(
                LossKind.HANG,
                f"no step completed for {stalled:.1f} s (the hang threshold {self.hang_threshold_s():.1f} s: "
                f"{HANG_STEP_FACTOR:g} x the recent p{HANG_PERCENTILE * 100:.0f} step time, "
                f"{LATEST_STEP_FACTOR:g} x the slowest of the last {LATEST_STEPS}, at least "
                f"elastic.hang_timeout_s={self.hang_timeout_s:g}); busy at {self.where.get(rank) or 'unknown'}",
            )
            for rank in culprits
        }

    def silent_while_failing(self, waiting_for: list[int], *, since: float) -> dict[int, Lost]:
        """Ranks still out while their generation fails (since ``since``), answering no poll, on a
        node Ray reports gone: lost with it, although Ray may take seconds more to report its
        actors dead. Silent ranks on live nodes are left to ``heartbeat_timeout_s``
        (``unresponsive_losses``) or the settling deadline (``stuck``).
        """
        now = self.clock()
        silent = [
            rank
            for rank in waiting_for
            if now - self.last_heard.get(rank, since) > SILENT_GRACE_S and now - since > SILENT_GRACE_S
        ]
        if not silent:
            return {}
        dead = self.dead_nodes()
        return {
            rank: Lost(LossKind.NODE_LOST, f"node {node} left the cluster", node)
            for rank in silent
            if (node := self.node_of(rank)) in dead
        }

    def stuck(self, ranks: list[int], *, generation: int, within_s: float) -> dict[int, Lost]:
        """Ranks that did not leave ``generation`` within ``within_s`` of its end being asked."""
        return {
            rank: Lost(
                LossKind.STUCK,
                f"did not leave generation {generation} within {within_s:g} s "
                f"(blocked at {self.where.get(rank) or 'unknown'})",
            )
            for rank in ranks
        }


class DrainWatch:
    """What is going away: nodes announced by a rank (a cloud notice) or marked draining by Ray,
    and single rank processes that were sent SIGTERM (``retiring``: their actors, not their nodes)."""

    def __init__(self, ray_draining: Callable[[], set[str]], hosts: Callable[[], set[str]] = lambda: set()) -> None:
        self.ray_draining = ray_draining  # one GCS call
        self.hosts = hosts  # alive nodes that could hold a rank (one GCS call)
        self.noticed: set[str] = set()
        self.retiring: set[object] = set()  # the slots (actors) of signalled processes
        self.reasons: dict[object, str] = {}  # why a retiring slot leaves, for the ``drain`` event

    def retire(self, slot: object, reason: str = "process told to end") -> bool:
        """A rank's process was told to end (or is a straggler to replace); True the first time it is heard of."""
        if slot in self.retiring:
            return False
        self.retiring.add(slot)
        self.reasons[slot] = reason
        return True

    def notice(self, node: str) -> bool:
        """A rank reports that ``node`` goes away; True the first time it is heard of."""
        if node in self.noticed:
            return False
        self.noticed.add(node)
        return True

    def nodes(self) -> set[str]:
        nodes = set(self.noticed)
        try:
            nodes |= self.ray_draining()
        except Exception as error:  # noqa: BLE001 - a GCS hiccup must not end the run
            log.debug("could not read draining nodes: %s", error)
        return nodes

    def nowhere_to_go(self, avoided: set[str]) -> set[str] | None:
        """The draining nodes, when every alive node that could hold a rank is draining or
        ``avoided`` (a drain of the last nodes: no capacity can come back to wait for); else None."""
        draining = self.nodes()
        if self.hosts() - draining - avoided:
            return None
        return draining | avoided

    def clear(self) -> None:
        """The mesh changed without the noticed nodes' and processes' ranks: their notices are handled."""
        self.noticed.clear()
        self.retiring.clear()
        self.reasons.clear()


def first_found(*findings: dict[int, Lost]) -> dict[int, Lost]:
    """Merge findings; for a rank found twice, the earlier finding stands."""
    merged: dict[int, Lost] = {}
    for found in findings:
        for rank, loss in found.items():
            merged.setdefault(rank, loss)
    return merged


def stuck_ranks(lost: Mapping[int, Lost]) -> set[int]:
    """The lost ranks whose actors are alive but did not leave the failed generation: they can
    still serve the peer-memory snapshots they hold."""
    return {rank for rank, loss in lost.items() if loss.kind == LossKind.STUCK}


def failure_fields(lost: dict[int, Lost]) -> dict[str, Any]:
    """The ``failure`` event's fields for these losses: kind(s), ranks, node(s), message."""
    kinds = sorted({loss.kind for loss in lost.values()})
    nodes = sorted({loss.node for loss in lost.values() if loss.node})
    return {
        "kind": kinds[0] if len(kinds) == 1 else ",".join(kinds),
        "ranks": sorted(lost),
        "node": nodes[0] if len(nodes) == 1 else (nodes or None),
        "message": group_errors({rank: loss.message for rank, loss in lost.items()}),
        # The tracebacks behind the one-line message, for whoever debugs it.
        "details": {str(rank): loss.message for rank, loss in lost.items() if "\n" in loss.message},
    }


def group_errors(messages: dict[int, str]) -> str:
    """Identical failures print once: ``[Rank 0, 1]: message``."""
    by_message: dict[str, list[int]] = {}
    for rank, text in sorted(messages.items()):
        by_message.setdefault(_last_line(text), []).append(rank)
    return "; ".join(f"[Rank {', '.join(map(str, ranks))}]: {message}" for message, ranks in by_message.items())


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text
