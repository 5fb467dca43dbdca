"""Retention: keep the last K committed checkpoints plus every M-th, clear what crashed writers left.

Runs on the driver, called by the commit coordinator right after a commit (so something newer
is always committed before anything is deleted). Deleting a checkpoint removes its manifest
first: from that moment it is invisible, and a crash halfway leaves only orphan shards, which a
later pass removes. Torch-free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from checkpointing.catalog import list_committed
from checkpointing.spec import manifest_key, step_of_key
from checkpointing.storage import StorageBackend

log = logging.getLogger(__name__)


@dataclass
class RetentionResult:
    deleted_steps: list[int] = field(default_factory=list)
    orphan_objects: list[str] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)


def steps_to_delete(committed: list[int], *, keep_last: int, keep_every: int = 0) -> list[int]:
    """Committed steps that fall outside the last ``keep_last`` and the multiples of ``keep_every``."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(committed)
    kept = set(ordered[-keep_last:])
    if keep_every > 0:
        kept |= {step for step in ordered if step % keep_every == 0}
    return [step for step in ordered if step not in kept]


def apply_retention(storage: StorageBackend, *, keep_last: int, keep_every: int = 0) -> RetentionResult:
    """Delete old checkpoints and leftovers older than the newest commit; abort stale uploads.

    Uploads and uncommitted objects of steps newer than the newest commit are left alone: their
    writers may still be at work.
    """
    result = RetentionResult()
    committed = list_committed(storage)
    if not committed:
        return result
    newest = committed[-1]
    doomed = steps_to_delete(committed, keep_last=keep_last, keep_every=keep_every)
    objects = storage.list("step-")
    for step in doomed:
        storage.delete([manifest_key(step)])  # invisible first, then the bytes
        storage.delete([info.key for info in objects if step_of_key(info.key) == step])
        result.deleted_steps.append(step)
    live = set(committed) - set(doomed)
    orphans = [
        info.key
        for info in objects
        if (object_step := step_of_key(info.key)) is not None
        and object_step < newest
        and object_step not in live
        and object_step not in doomed
    ]
    if orphans:
        storage.delete(orphans)
        result.orphan_objects.extend(orphans)
    for upload in storage.list_pending_uploads("step-"):
        upload_step = step_of_key(upload.key)
        if upload_step is not None and upload_step <= newest:
            storage.abort_pending_upload(upload)
            result.aborted_uploads.append(upload.key)
    if doomed or orphans or result.aborted_uploads:
        log.info(
            "retention under %s: deleted steps %s, %d orphan objects, %d stale uploads aborted",
            storage.uri,
            doomed,
            len(orphans),
            len(result.aborted_uploads),
        )
    return result
