"""Checkpoint errors a user can act on: each message names the object or setting and the fix.

Raised on both sides (driver and ranks). ``orchestrator.errors.user_error_types`` lists
``CheckpointError``, so the CLI prints the message on one line, without a traceback, and exits 2.
No message ever holds a credential: only bucket names, object keys, endpoints and step numbers.

A class that says why a rank failed declares ``failure_kind``: the value of a
``workers.spec.messages.FailureKind`` member, as a string, because ``checkpointing/`` does not
import ``workers/`` (``failure_kind_of`` reads it back as the member).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint that cannot be written, found, read or trusted."""

    exit_code = 2


class CorruptCheckpointError(CheckpointError):
    """Stored bytes disagree with their checksum or their format; ``key`` names the object."""

    failure_kind = "corrupt_checkpoint"  # FailureKind.CORRUPT_CHECKPOINT

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key

    def __reduce__(self):
        # Raised on a rank, handled on the driver: it must survive pickling with its key.
        return _corrupt, (str(self), self.key)


def _corrupt(message: str, key: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(message, key=key)


class ManifestVersionError(CheckpointError):
    """The manifest was written by a newer meshpilot (or is not ours)."""


class ForeignCheckpointError(CheckpointError):
    """The checkpoint belongs to another model or config than the one asking to load it."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint (or not the step asked for) under the URI."""


class CommitConflictError(CheckpointError):
    """A manifest already exists for this step: the commit (put-if-absent) was refused."""


class StorageAccessError(CheckpointError):
    """The storage cannot be reached or refuses us; subclasses say which and how to fix it."""

    failure_kind = "storage"  # FailureKind.STORAGE


class StorageCredentialsError(StorageAccessError):
    """Missing, unknown or wrong credentials, or a key without the needed permission."""


class StorageNotFoundError(StorageAccessError):
    """The bucket (or the local directory's parent) does not exist."""


class StorageUnreachableError(StorageAccessError):
    """No answer from the endpoint (wrong URL, server down, network)."""


class HfCheckpointError(CheckpointError):
    """A Hugging Face model directory that cannot be read, or that does not fit the model asking for it."""

    failure_kind = "own_error"  # FailureKind.OWN_ERROR: the user's input is wrong, not the storage
