"""Why a rank's call failed, as the rank reports it to the driver: the failure kind and the text.

Runs on every rank, in the rank actor's loop (``run``) and its ``configure``. The kind decides
how the driver counts the failure: a rank's own error is a loss, a peer's failure seen by this
rank (a closed connection, a generation the driver aborted) is an echo.
"""

from __future__ import annotations

import traceback

from workers.spec.messages import FailureKind, failure_kind_of


class PeerFailedWhileConfiguring(RuntimeError):
    """``configure`` failed because another rank did (its connection closed, or the driver
    aborted the generation): this rank is an echo, and keeps whatever state it held."""

    failure_kind = FailureKind.PEER_FAILURE


def classify_failure(error: BaseException, *, aborted: bool) -> FailureKind:
    """Rank side, the loop thread: why ``run`` failed, from what this rank knows and the error's type.

    ``aborted``: the driver aborted this generation's groups before the error, so whatever
    torch says, the error is a consequence of another rank's failure (PEER_FAILURE). Else the
    kind the exception declares (``failure_kind``: checkpoint errors, injected faults, the
    commit vote's timeout), else what torch's error says (``checkpointing/torch_compat.py``):
    a closed or reset connection to a peer is PEER_FAILURE, this rank's own wait running past
    its timeout is TIMEOUT; an out-of-memory error is OUT_OF_MEMORY; anything else is OWN_ERROR.

    An untyped error raised ``from`` another (``__cause__``) is classified as that cause:
    torch's pipeline stage wraps a peer's closed gloo connection in a plain RuntimeError
    ("[Stage 0] failed to run forward"), and that rank is an echo of the peer's death, not a
    failure of its own (counted as lost, it would take its healthy peer-memory snapshot with it).
    """
    if aborted:
        return FailureKind.PEER_FAILURE
    cause: BaseException | None = error
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        kind = _kind_of(cause)
        if kind != FailureKind.OWN_ERROR or getattr(cause, "failure_kind", None) is not None:
            return kind
        cause = cause.__cause__
    return FailureKind.OWN_ERROR


def _kind_of(error: BaseException) -> FailureKind:
    """The kind ``error`` itself declares, else what torch says of it, else the kind its type maps
    to (an out-of-memory error), else OWN_ERROR."""
    from checkpointing.torch_compat import collective_failure

    if getattr(error, "failure_kind", None) is not None:
        return failure_kind_of(error)
    torch_says = collective_failure(error)
    return FailureKind(torch_says) if torch_says is not None else failure_kind_of(error)


def describe_error(error: BaseException) -> str:
    """The last frames of ``error``'s traceback and its message, for the driver's failure event."""
    frames = traceback.format_exception(type(error), error, error.__traceback__, limit=-6)
    return "".join(frames).strip()
