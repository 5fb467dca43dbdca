"""Remote calls fanned out to many rank actors, and what became of each one.

Runs on the driver. ``PendingCalls`` holds the refs of one method called on every active rank
(``configure``, ``run``, ``poll``) and collects their results as they arrive. A call that did
not return becomes a ``CallFailed`` value: the actor died, or the method raised (then the
exception's declared ``failure_kind`` comes with it). The controller never handles a Ray
exception itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import ray

from workers.spec.messages import FailureKind, RunOutcome, RunStatus, failure_kind_of


class CallFailedKind(StrEnum):
    """How a remote call failed to return."""

    DIED = "died"  # the actor's process is gone
    ERROR = "error"  # the method raised (or Ray could not run it)


@dataclass(frozen=True)
class CallFailed:
    """A remote call that did not return: the actor died (``DIED``) or raised (``ERROR``)."""

    kind: CallFailedKind
    message: str
    # For a method that raised: the kind its exception declares (see ``failure_kind_of``).
    failure_kind: FailureKind | None = None


class PendingCalls:
    """One method called on many ranks (driver side); results are collected as they arrive.

    Results are the method's return values, or ``CallFailed`` for an actor that died or
    raised, keyed by rank.
    """

    def __init__(self, refs: list[Any]) -> None:
        self.refs = list(refs)
        self.results: dict[int, Any] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.refs)

    def collect(self, timeout: float, *, first: bool = False) -> dict[int, Any]:
        """Wait up to ``timeout`` seconds for all results (with ``first``: until any one arrives);
        returns the results that arrived in this call."""
        waiting = [ref for index, ref in enumerate(self.refs) if index not in self.results]
        if not waiting:
            return {}
        ready, _ = ray.wait(waiting, num_returns=1 if first else len(waiting), timeout=timeout)
        if first and ready:  # and whatever else is ready by now
            ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0)
        arrived = {}
        for ref in ready:
            index = self.refs.index(ref)
            arrived[index] = self.results[index] = result_of(ref)
        return arrived


def result_of(ref: Any) -> Any:
    """The value behind a ready ref, or ``CallFailed`` when the call did not return one."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as error:
        return CallFailed(CallFailedKind.DIED, _first_line(error))
    except ray.exceptions.RayError as error:
        return CallFailed(CallFailedKind.ERROR, _first_line(error), failure_kind=_failure_kind(error))


def run_status(result: RunOutcome | CallFailed) -> RunStatus | CallFailedKind:
    """How a rank's ``run`` call ended: its outcome's status; ``died`` or ``failed`` for one that
    did not return."""
    if isinstance(result, CallFailed):
        return CallFailedKind.DIED if result.kind == CallFailedKind.DIED else RunStatus.FAILED
    return result.status


def _failure_kind(error: ray.exceptions.RayError) -> FailureKind | None:
    """What the method's own exception declares; None when Ray failed before the method ran."""
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and cause is not None:
        return failure_kind_of(cause)
    return None


def _first_line(error: BaseException) -> str:
    """The line that says what went wrong: for a task that raised, its exception, not Ray's header."""
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and cause is not None:
        return f"{type(cause).__name__}: {cause}".strip().splitlines()[-1]
    text = str(error).strip()
    if isinstance(error, ray.exceptions.RayActorError) and error.actor_init_failed and text:
        # Ray's header, then the constructor's traceback: its last line is the exception.
        return text.splitlines()[-1].strip()
    return text.splitlines()[0] if text else type(error).__name__
