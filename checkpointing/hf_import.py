"""Import a Hugging Face model directory as a committed meshpilot checkpoint (weights only, step 0).

Runs in ``meshpilot ckpt import`` (one process, no process group)::

    manifest = import_hf(open_storage(HF_DIR), open_storage(CKPT_URI), names=family_names, model=model_dict)

One tensor at a time: it is read by ranged GETs into a host tensor, written as its own shard
file by a ``CheckpointWriter`` (the files are numbered like the ranks of a save), and freed, so
memory stays about twice the largest tensor. The writers' reports become the manifest through
``build_manifest`` and the manifest is committed with put-if-absent, exactly as the driver
commits a training save; ``ckpt ls|inspect|verify|export`` and ``restore`` read the result like
any other step. ``extra`` marks it weights-only: a job resuming from it loads the parameters
and starts its optimizer fresh (``workers/checkpoints.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from checkpointing.catalog import list_committed
from checkpointing.errors import CheckpointError, CommitConflictError, HfCheckpointError
from checkpointing.hf_format import (
    HfCheckpoint,
    HfName,
    check_hf_shape,
    find_hf_tensor,
    load_hf_tensors,
    open_hf_checkpoint,
)
from checkpointing.manifest import Manifest, build_manifest
from checkpointing.spec import WEIGHTS_ONLY, FailureReport, ShardReport, manifest_key
from checkpointing.storage import StorageBackend
from checkpointing.writer import CheckpointWriter

IMPORT_STEP = 0
DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def import_hf(
    source: StorageBackend,
    dest: StorageBackend,
    *,
    names: Mapping[str, HfName],
    model: dict[str, Any],
    dtype: str | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    checkpoint: HfCheckpoint | None = None,
) -> Manifest:
    """Write every parameter of ``names`` (our FQN -> HF name, or names stacked) as step 0 under ``dest``.

    ``model`` is the manifest's model description (what a job's restore compares with its own);
    ``dtype`` None keeps each tensor's stored dtype, else floating-point tensors are cast to it;
    ``shapes`` (FQN -> the model's parameter shape), when given, are checked before anything is
    written; ``checkpoint`` is ``open_hf_checkpoint(source)`` when the caller already has it.
    Refuses a ``dest`` that already holds committed steps. On failure nothing is committed and
    the files written so far are deleted.
    """
    if dtype is not None and dtype not in DTYPE_CHOICES:
        raise CheckpointError(f"--dtype {dtype!r}: choose {', '.join(DTYPE_CHOICES)}")
    committed = list_committed(dest)
    if committed:
        shown = ", ".join(map(str, committed[-5:]))
        raise HfCheckpointError(
            f"{dest.uri} already holds committed checkpoints (steps {shown}): an import starts a new "
            "checkpoint history; import into a fresh URI"
        )
    if not names:
        raise HfCheckpointError(f"nothing to import from {source.uri}: the name map is empty")
    if checkpoint is None:
        checkpoint = open_hf_checkpoint(source)
    for fqn in names:  # every name and shape is checked before the first byte is written
        found = find_hf_tensor(checkpoint, fqn, names)
        if shapes is not None:
            check_hf_shape(checkpoint, found, tuple(shapes[fqn]))
    extra = {WEIGHTS_ONLY: True, "imported_from": checkpoint.uri}
    reports: list[ShardReport] = []
    try:
        for number, fqn in enumerate(sorted(names)):
            reports.append(_import_one(source, checkpoint, dest, fqn, names, dtype, number=number, extra=extra))
        manifest = build_manifest(
            reports, step=IMPORT_STEP, world_size=len(reports), mesh={}, model=model, config_hash=None
        )
        if not dest.put_if_absent(manifest_key(IMPORT_STEP), manifest.to_json()):
            raise CommitConflictError(
                f"step {IMPORT_STEP} was committed under {dest.uri} while importing: another import or run "
                "writes there; import into a fresh URI"
            )
    except BaseException:
        dest.delete([entry.key for report in reports for entry in report.files])  # uncommitted: never visible
        raise
    return manifest


def _import_one(
    source: StorageBackend,
    checkpoint: HfCheckpoint,
    dest: StorageBackend,
    fqn: str,
    names: Mapping[str, HfName],
    dtype: str | None,
    *,
    number: int,
    extra: dict[str, Any],
) -> ShardReport:
    """Read one HF tensor whole and write it as shard file ``number`` of the import."""
    found = find_hf_tensor(checkpoint, fqn, names)
    stored = getattr(torch, found.dtype)
    target = getattr(torch, dtype) if dtype is not None and stored.is_floating_point else stored
    tensor = torch.empty(found.shape, dtype=target)
    load_hf_tensors(source, checkpoint, {fqn: tensor}, names)
    outcome: list[ShardReport | FailureReport] = []
    writer = CheckpointWriter(dest, rank=number, report=outcome.append)
    try:
        writer.save_sync(IMPORT_STEP, {fqn: tensor}, extra=extra, owns_plain_tensors=True)
    finally:
        writer.close()
    report = outcome[0]
    assert isinstance(report, ShardReport), "save_sync raises when the upload failed"
    return report
