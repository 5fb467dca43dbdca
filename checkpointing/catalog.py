"""What is committed under a checkpoint URI, and which checkpoint to resume from. Torch-free.

Runs on the driver (resume decision, retention, CLI) and on the ranks (restore reads the
manifest the driver chose). A checkpoint exists once its manifest exists, and not before
(DESIGN.md invariant 1), so listing manifests is listing checkpoints.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from checkpointing.errors import CheckpointNotFoundError, CorruptCheckpointError, ForeignCheckpointError
from checkpointing.manifest import Manifest, parse_manifest
from checkpointing.spec import MANIFEST_NAME, manifest_key, step_prefix
from checkpointing.storage import StorageBackend

log = logging.getLogger(__name__)
_MANIFEST_KEY = re.compile(r"^step-(\d{8,})/" + re.escape(MANIFEST_NAME) + "$")


def list_committed(storage: StorageBackend) -> list[int]:
    """Every committed step under the URI, oldest first."""
    steps = []
    for info in storage.list("step-"):
        match = _MANIFEST_KEY.match(info.key)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_committed(storage: StorageBackend) -> int | None:
    """The newest committed step, or None when there is none."""
    steps = list_committed(storage)
    return steps[-1] if steps else None


def load_manifest(storage: StorageBackend, step: int | None = None) -> Manifest:
    """The manifest of ``step`` (the newest committed when None), parsed and validated."""
    if step is None:
        step = latest_committed(storage)
        if step is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {storage.uri}")
    key = manifest_key(step)
    try:
        data = storage.get(key)
    except CheckpointNotFoundError:
        committed = list_committed(storage)
        hint = f"committed steps: {', '.join(map(str, committed[-10:]))}" if committed else "none is committed"
        raise CheckpointNotFoundError(f"no committed checkpoint for step {step} under {storage.uri} ({hint})") from None
    manifest = parse_manifest(data, key=f"{storage.uri}/{key}")
    if manifest.step != step:
        raise CorruptCheckpointError(f"{storage.uri}/{key} says it is step {manifest.step}", key=key)
    return manifest


def check_compatible(
    manifest: Manifest,
    *,
    model: dict[str, Any] | None = None,
    config_hash: str | None = None,
    lora_base: Mapping[str, Any] | None = None,
    uri: str = "",
) -> None:
    """Refuse a checkpoint of another model (shape), or when given, of a LoRA run on another base
    (``lora_base``: the job's {source, sha256}) or of another config hash."""
    where = f"{uri} step {manifest.step}".strip()
    if model is not None:
        differences = [
            f"{name}: checkpoint {manifest.model.get(name)!r} vs job {model.get(name)!r}"
            for name in sorted(set(model) | set(manifest.model))
            if manifest.model.get(name) != model.get(name)
        ]
        if differences:
            raise ForeignCheckpointError(
                f"checkpoint {where} belongs to another model ({'; '.join(differences)}); point checkpoint.uri at "
                "this job's checkpoints or change model: to match"
            )
    if lora_base is not None:
        check_same_base(manifest, lora_base, uri=uri)
    if config_hash is not None and manifest.config_hash is not None and manifest.config_hash != config_hash:
        raise ForeignCheckpointError(
            f"checkpoint {where} was written by another config (hash {manifest.config_hash}, this job "
            f"{config_hash}): model, training or data settings differ; use a fresh checkpoint.uri or the same config"
        )


def check_same_base(manifest: Manifest, lora_base: Mapping[str, Any], *, uri: str = "") -> None:
    """Refuse a LoRA checkpoint whose adapters were trained beside another base than ``lora_base``
    (the job's {source, sha256}: its hash differs), or a checkpoint of every weight for a LoRA job."""
    where = f"{uri} step {manifest.step}".strip()
    if manifest.lora is None:
        raise ForeignCheckpointError(
            f"checkpoint {where} holds every weight, not LoRA adapters: this job trains adapters (model.lora); "
            "use a fresh checkpoint.uri, or remove model.lora to resume full training"
        )
    found = manifest.lora_base
    if found is not None and found.get("sha256") != lora_base.get("sha256"):
        raise ForeignCheckpointError(
            f"checkpoint {where} holds LoRA adapters trained on the base {found.get('source')} (sha256 "
            f"{found.get('sha256')}), but this job's base {lora_base.get('source')} has sha256 "
            f"{lora_base.get('sha256')}: point model.init_from at the base the adapters were trained on, or use a "
            "fresh checkpoint.uri"
        )


def missing_objects(storage: StorageBackend, manifest: Manifest) -> list[str]:
    """Files the manifest lists that are absent or of the wrong size (one LIST call)."""
    present = {info.key: info.size for info in storage.list(step_prefix(manifest.step))}
    return [
        f"{entry.key} ({'missing' if entry.key not in present else f'{present[entry.key]} bytes, expected {entry.bytes}'})"  # noqa: E501
        for entry in manifest.files
        if present.get(entry.key) != entry.bytes
    ]


def choose_restore(
    storage: StorageBackend,
    *,
    model: dict[str, Any] | None = None,
    config_hash: str | None = None,
    lora_base: Mapping[str, Any] | None = None,
    skip_steps: Iterable[int] = (),
    warn: Callable[[str], None] = log.warning,
) -> Manifest | None:
    """The newest committed checkpoint that is intact enough to restore, or None if there is none.

    Runs on the driver before it tells the ranks what to restore. A corrupt manifest or a
    missing shard makes it fall back to the previous step with a warning; a foreign checkpoint
    raises (the whole URI belongs to another job). ``skip_steps`` holds steps a rank already
    found corrupt while restoring (block checksums are checked there, on the bytes it reads).
    """
    skipped = set(skip_steps)
    for step in reversed(list_committed(storage)):
        if step in skipped:
            continue
        try:
            manifest = load_manifest(storage, step)
        except CorruptCheckpointError as error:
            warn(f"checkpoint step {step} is unusable ({error}); falling back to the previous committed step")
            continue
        check_compatible(manifest, model=model, config_hash=config_hash, lora_base=lora_base, uri=storage.uri)
        missing = missing_objects(storage, manifest)
        if missing:
            warn(
                f"checkpoint step {step} is unusable (shard {missing[0]}); falling back to the previous committed step"
            )
            continue
        return manifest
    return None
