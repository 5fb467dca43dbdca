"""The driver's side of checkpoints: commit what the ranks uploaded, choose what to resume from.

Runs on the driver (no torch). The ranks upload their shards and report; ``on_report`` hands
the upload of each ``CheckpointUploadReport`` to the commit coordinator, which writes the
manifest (the commit) once every rank of the step is durable, and turns the outcome into
``checkpoint_committed`` / ``checkpoint_failed`` events. ``NoCheckpoints`` stands in when ``checkpoint.uri`` is unset.
``CheckpointCommits`` is what the controller, the mesh change and the restore use of either.
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

from checkpointing.catalog import choose_restore, latest_committed
from checkpointing.commit import CommitCoordinator
from checkpointing.manifest import Manifest
from checkpointing.storage import open_storage
from elastic.spec import MeshSpec
from orchestrator.config import JobConfig
from orchestrator.observe.events import EventLog
from workers.spec.lora import LoraBase
from workers.spec.messages import CheckpointUploadReport

log = logging.getLogger("meshpilot")


class ResumePoint(Protocol):
    """What the driver reads of a committed checkpoint's manifest to resume from it."""

    @property
    def step(self) -> int: ...
    @property
    def mesh(self) -> dict[str, Any]: ...


class CheckpointCommits(Protocol):
    """The driver's checkpoints as the controller sees them (``DriverCheckpoints``, ``NoCheckpoints``)."""

    @property
    def enabled(self) -> bool: ...
    @property
    def uri(self) -> str | None: ...
    def check_access(self) -> None: ...
    def on_report(self, report: CheckpointUploadReport) -> None: ...
    def reset(
        self, mesh: MeshSpec, *, generation: int, paused_after: int | None = None, lost: frozenset[int] = frozenset()
    ) -> None: ...
    def latest_step(self) -> int | None: ...
    def choose_resume(self, skip_steps: AbstractSet[int] = frozenset()) -> ResumePoint | None: ...


class NoCheckpoints:
    enabled = False
    uri = None

    def check_access(self) -> None:
        return None

    def on_report(self, report: CheckpointUploadReport) -> None:
        return None

    def reset(
        self, mesh: MeshSpec, *, generation: int, paused_after: int | None = None, lost: frozenset[int] = frozenset()
    ) -> None:
        return None

    def latest_step(self) -> int | None:
        return None

    def choose_resume(self, skip_steps: AbstractSet[int] = frozenset()) -> Manifest | None:
        return None


class DriverCheckpoints:
    enabled = True

    def __init__(
        self, config: JobConfig, events: EventLog, *, mesh: MeshSpec, lora_base: LoraBase | None = None
    ) -> None:
        """``lora_base``: a LoRA job's frozen base; a checkpoint trained beside another is refused."""
        target = config.checkpoint
        assert target.uri is not None  # driver_checkpoints builds this only when checkpoint.uri is set
        self.events = events
        self.model = config.model_spec.to_dict()
        self.config_hash = config.config_hash()
        self.lora_base = None if lora_base is None else lora_base.to_dict()
        self.storage = open_storage(
            target.uri,
            endpoint_url=target.endpoint_url,
            region=target.region,
            part_size=target.part_size_mb << 20,
            concurrency=target.upload_concurrency,
        )
        self.uri = self.storage.uri
        self.coordinator = CommitCoordinator(
            self.storage,
            world_size=mesh.world_size,
            mesh=mesh.as_dict(),
            config_hash=self.config_hash,
            model=self.model,
            keep_last=target.keep_last,
            keep_every=target.keep_every,
            on_failure=self._failed,
        )

    def check_access(self) -> None:
        """Raise the storage's clear error (credentials, bucket, endpoint) before any rank starts."""
        self.storage.check_access()

    def on_report(self, report: CheckpointUploadReport) -> None:
        manifest = self.coordinator.on_report(report.upload, generation=report.generation)
        if manifest is not None:
            self._committed(manifest)

    def reset(
        self, mesh: MeshSpec, *, generation: int, paused_after: int | None = None, lost: frozenset[int] = frozenset()
    ) -> None:
        """The mesh of ``generation`` starts. After a pause (``paused_after``, nobody ``lost``)
        the old mesh's saves still complete; after an in-place shrink (``paused_after`` and the
        ``lost`` ranks of the old mesh, a whole replica surviving) they complete without the
        lost ranks when those held only copies; otherwise half-reported saves of the old mesh
        never complete."""
        for manifest in self.coordinator.reset(
            world_size=mesh.world_size, mesh=mesh.as_dict(), generation=generation, paused_after=paused_after, lost=lost
        ):
            self._committed(manifest)

    def _committed(self, manifest: Manifest) -> None:
        self.events.emit(
            "checkpoint_committed",
            step=manifest.step,
            uri=self.uri,
            bytes=manifest.total_bytes,
            upload_s=round(manifest.upload_s, 3),
        )

    def latest_step(self) -> int | None:
        try:
            return latest_committed(self.storage)
        except Exception as error:  # noqa: BLE001 - storage down: no checkpoint to count on now
            log.warning("cannot list checkpoints under %s: %s", self.uri, error)
            return None

    def choose_resume(self, skip_steps: AbstractSet[int] = frozenset()) -> Manifest | None:
        """The newest intact, compatible checkpoint (falls back past corrupt ones with a warning)."""
        return choose_restore(
            self.storage,
            model=self.model,
            config_hash=self.config_hash,
            lora_base=self.lora_base,
            skip_steps=skip_steps,
            warn=log.warning,
        )

    def _failed(self, step: int, reason: str, cause: str) -> None:
        self.events.emit("checkpoint_failed", step=step, error=reason, reason=cause)


def driver_checkpoints(config: JobConfig, events: EventLog, *, lora_base: LoraBase | None = None) -> CheckpointCommits:
    """The job's checkpoint commits: to ``checkpoint.uri``, or none when it is unset."""
    if config.checkpoint.uri is None:
        return NoCheckpoints()
    return DriverCheckpoints(config, events, mesh=config.mesh, lora_base=lora_base)
