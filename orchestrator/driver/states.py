"""The controller's states: frozen values carrying all their data, and how a run ends.

Runs on the driver. The controller (``orchestrator.driver.controller``) holds one of these and
replaces it on every ``step()`` with what the state's handler returned; a state is never
mutated, only rebuilt with ``dataclasses.replace``. The calls a state holds (``calls``) are the
ranks' in-flight remote calls of that generation, which fill in as they return.

A handler that wants a new generation configured (a start, a mesh change, a restore) returns a
``NextGeneration`` instead of a state: what the ranks start from, not how. The controller
configures it in the same ``step()`` (``Controller._configure``), which makes it ``Configuring``.

    Starting -> Configuring -> Running -----------------------------> Finished
                     ^            | failure, drain notice, grow
                     |            v
                     +------- Settling: wait until every surviving rank has left the
                     |        generation (aborted step, or paused at a step boundary), then
                     |        let the policy decide: shrink / refill / grow, restore, or fail
                     |            | restore: no complete replica group survived
                     |            v
                     +------- AwaitingActors: gather warm actors for the checkpoint's restore

Any state ends in ``Finished`` when the run fails, is interrupted (Ctrl-C) or preempted (SIGTERM).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from enum import StrEnum

from elastic.spec import MeshSpec
from orchestrator.driver.detector import Lost
from orchestrator.driver.group import Calls
from orchestrator.driver.peer_memory import RecoveryPoint
from workers.spec.messages import StartFrom

log = logging.getLogger("meshpilot")


class SettlePurpose(StrEnum):
    """Why a generation is ending; a recovery's ``cause`` in the ``recovered`` event."""

    FAILURE = "failure"  # ranks were lost: the step in flight is aborted everywhere
    DRAIN = "drain"  # a node is going away: pause at the next step boundary
    GROW = "grow"  # warm actors can join: pause at the next step boundary


class RunEnd(StrEnum):
    """How a run ended: the ``done`` event's ``status`` and the CLI's result."""

    FINISHED = "finished"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # Ctrl-C
    PREEMPTED = "preempted"  # SIGTERM: saved at a step boundary, a rerun resumes there


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_PREEMPTED = 143  # 128 + SIGTERM
EXIT_CODES = {
    RunEnd.FINISHED: EXIT_OK,
    RunEnd.FAILED: EXIT_FAILED,
    RunEnd.INTERRUPTED: EXIT_INTERRUPTED,
    RunEnd.PREEMPTED: EXIT_PREEMPTED,
}


@dataclass(frozen=True)
class Starting:
    mesh: MeshSpec


@dataclass(frozen=True)
class Configuring:
    """Every active rank builds generation ``generation`` of ``mesh``; ``calls`` return its step."""

    generation: int
    mesh: MeshSpec
    calls: Calls
    deadline: float
    # Set when the ranks load a checkpoint: its step and the mesh that wrote it.
    restoring: int | None = None
    from_mesh: dict | None = None
    started_at: float = 0.0
    # A mesh change of a running job (not its first start): a failure while configuring
    # restarts the recovery instead of ending the run.
    recovering: bool = False
    # Ranks that hold no state of the job until this configuration fills it (joining actors, or
    # every rank of a restore): should it fail, their replica groups cannot be kept.
    stateless: frozenset[int] = frozenset()
    # Set when the ranks load a peer-memory snapshot (``restoring`` is its step).
    memory: RecoveryPoint | None = None


@dataclass(frozen=True)
class AwaitingActors:
    """No replica survived: wait for enough actors to restore ``step`` onto (a checkpoint, or
    the peer-memory snapshot ``memory``)."""

    step: int
    mesh: MeshSpec
    began_at: float
    deadline: float
    lost_steps: int
    memory: RecoveryPoint | None = None


@dataclass(frozen=True)
class Running:
    """The ranks train; ``calls`` are their ``run`` calls, which return when the loop ends."""

    generation: int
    mesh: MeshSpec
    calls: Calls


@dataclass(frozen=True)
class Settling:
    """A generation is ending: a failure (abort issued) or a pause for a drain or a grow."""

    generation: int
    mesh: MeshSpec
    calls: Calls
    purpose: SettlePurpose
    lost: dict[int, Lost] = field(default_factory=dict)
    draining: frozenset[int] = frozenset()
    started_at: float = 0.0
    deadline: float = 0.0
    # Ranks holding no state of the job (a failed configuration's joiners): healthy, but their
    # replica groups cannot be kept.
    stateless: frozenset[int] = frozenset()
    # The generation failed while it was configured, before running a step.
    configuring: bool = False
    # When the last rank's run call returned (monotonic), once every one has.
    all_returned_at: float | None = None
    # Whether the leaving replica groups are refilled from warm actors (not for excluded stragglers).
    refill: bool = True

    def noting_returns(self, now: float) -> Settling:
        """This state, with ``all_returned_at`` set to ``now`` the first time every call has returned."""
        if self.all_returned_at is None and self.calls.done:
            return replace(self, all_returned_at=now)
        return self


@dataclass(frozen=True)
class Finished:
    status: RunEnd
    exit_code: int
    reason: str | None = None

    @classmethod
    def of(cls, status: RunEnd, reason: str | None = None) -> Finished:
        """The terminal state for ``status``, with its exit code."""
        return cls(status, EXIT_CODES[status], reason=reason)


def run_failed(kind: str, message: str) -> Finished:
    """The terminal state of a run that failed (``kind``: at what, for the log), logged as an error."""
    log.error("run failed (%s): %s", kind, message)
    return Finished.of(RunEnd.FAILED, reason=message)


State = Starting | Configuring | Running | Settling | AwaitingActors | Finished


@dataclass(frozen=True)
class NextGeneration:
    """A generation to configure on the active actors: ``mesh``, and what each rank starts from.

    Not a state: a handler returns it and the controller configures it in the same step.
    ``restoring``/``from_mesh``: every rank loads that step (written from that mesh); with
    ``memory``, from that peer-memory snapshot. ``stateless``: ranks that hold no state until
    this configuration fills them (joiners). ``paused_after=S``: the previous generation stopped
    after step S with every rank alive but ``lost`` (a whole replica among the survivors), so
    its checkpoint uploads still in flight commit with its mesh.
    """

    mesh: MeshSpec
    starts: tuple[StartFrom, ...]
    sync_replicas: bool = False
    restoring: int | None = None
    from_mesh: dict | None = None
    stateless: frozenset[int] = frozenset()
    memory: RecoveryPoint | None = None
    paused_after: int | None = None
    lost: frozenset[int] = frozenset()


# What a state's handler returns: the next state, or a generation to configure.
Next = State | NextGeneration
