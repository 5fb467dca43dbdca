"""``CommitCoordinator``: the driver side of a save — wait for every rank, then commit the manifest.

Runs on the driver (the controller), never on a rank; torch-free. The controller feeds it every
checkpoint upload report (``ShardReport`` or ``FailureReport``, frozen, ``checkpointing/spec.py``) that
reaches it from the ranks' ``CheckpointWriter``::

    coordinator = CommitCoordinator(storage, world_size=8, mesh=mesh_dict, config_hash=h,
                                    model=model_dict, keep_last=3, keep_every=0)
    manifest = coordinator.on_report(shard_report)    # None until the step is complete
    if manifest: emit checkpoint_committed(step, uri, bytes, upload_s)

When all ``world_size`` reports of a step are in and none failed, it merges them into a
manifest, checks that the chunks tile every tensor exactly once, and writes the manifest with
put-if-absent: that write is the commit. Then retention runs. A failure report, an incomplete
tiling or a refused commit marks the step failed (``failed_steps``, ``on_failure(step, reason,
cause)`` with cause ``storage``), and so does a change of mesh before every rank reported (cause
``interrupted``); nothing is committed for it and training is never interrupted by it. A mesh
that paused with every rank alive (a grow, a drain) is not waited for: its uploads go on in the
background and its steps still commit, each with the mesh that saved it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from checkpointing.errors import CheckpointError, CommitConflictError
from checkpointing.manifest import Manifest, build_manifest
from checkpointing.retention import RetentionResult, apply_retention
from checkpointing.spec import FailureReport, ShardReport, manifest_key, report_from_dict
from checkpointing.storage import StorageBackend

log = logging.getLogger(__name__)
# Why a step is not committed when the mesh changes before every rank reported its shards.
MESH_CHANGED = "the mesh changed before every rank reported"


@dataclass(frozen=True)
class _PausedMesh:
    """A mesh that paused after ``last_step`` with every rank alive: its saves may still report."""

    last_step: int
    world_size: int
    mesh: dict[str, Any]


class CommitCoordinator:
    """Collects per-rank reports and commits each complete step exactly once."""

    def __init__(
        self,
        storage: StorageBackend,
        *,
        world_size: int,
        mesh: dict[str, Any],
        config_hash: str | None,
        model: dict[str, Any],
        keep_last: int,
        keep_every: int = 0,
        on_failure: Callable[[int, str, str], None] | None = None,
    ) -> None:
        self.storage = storage
        self.world_size = world_size
        self.mesh = dict(mesh)
        self.config_hash = config_hash
        self.model = dict(model)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._on_failure = on_failure
        self._pending: dict[int, dict[int, ShardReport]] = {}
        self._paused_meshes: list[_PausedMesh] = []  # oldest first
        self.committed_steps: list[int] = []
        self.failed_steps: dict[int, str] = {}
        self.last_retention: RetentionResult | None = None

    @property
    def pending_steps(self) -> list[int]:
        return sorted(self._pending)

    def reset(self, *, world_size: int, mesh: dict[str, Any], paused_after: int | None = None) -> None:
        """The mesh changed (shrink, grow, restore).

        ``paused_after=S``: the old mesh paused after step S with every rank alive, and its
        ranks finish their uploads in the background, so its steps (up to S) still commit with
        the old mesh. Otherwise (a rank was lost, or a restore rewinds) half-reported steps of
        every earlier mesh fail.
        """
        if paused_after is None:
            for step in self._pending:
                self._fail(step, MESH_CHANGED, cause="interrupted")
            self._pending.clear()
            self._paused_meshes.clear()
        else:
            self._paused_meshes.append(_PausedMesh(paused_after, self.world_size, self.mesh))
        self.world_size = world_size
        self.mesh = dict(mesh)

    def _mesh_of(self, step: int) -> tuple[int, dict[str, Any]]:
        """The world size and mesh that saved ``step``: a paused mesh's, or the current one."""
        for paused in self._paused_meshes:
            if step <= paused.last_step:
                return paused.world_size, paused.mesh
        return self.world_size, self.mesh

    def on_report(self, report: ShardReport | FailureReport | dict[str, Any]) -> Manifest | None:
        """Record one rank's report; return the manifest when this report completed a commit.

        A report that crossed a process boundary as JSON (a dict) is rebuilt first.
        """
        if isinstance(report, (ShardReport, FailureReport)):
            parsed = report
        else:
            try:
                parsed = report_from_dict(report)
            except (ValueError, KeyError, TypeError) as error:
                log.warning("ignoring a malformed checkpoint report: %s", error)
                return None
        step = parsed.step
        if step in self.failed_steps or step in self.committed_steps:
            return None
        world_size, mesh = self._mesh_of(step)
        if not 0 <= parsed.rank < world_size:
            log.warning(
                "ignoring a checkpoint report of step %d from rank %d outside world size %d",
                step,
                parsed.rank,
                world_size,
            )
            return None
        if isinstance(parsed, FailureReport):
            self._pending.pop(step, None)
            self._fail(step, f"rank {parsed.rank} gave up after {parsed.attempts} attempt(s): {parsed.error}")
            return None
        reports = self._pending.setdefault(step, {})
        reports[parsed.rank] = parsed
        if len(reports) < world_size:
            return None
        del self._pending[step]
        return self._commit(step, list(reports.values()), world_size=world_size, mesh=mesh)

    def _commit(
        self, step: int, reports: list[ShardReport], *, world_size: int, mesh: dict[str, Any]
    ) -> Manifest | None:
        try:
            manifest = build_manifest(
                reports, step=step, world_size=world_size, mesh=mesh, model=self.model, config_hash=self.config_hash
            )
            if not self.storage.put_if_absent(manifest_key(step), manifest.to_json()):
                raise CommitConflictError(
                    f"step {step} is already committed under {self.storage.uri}; "
                    "another run writes to the same checkpoint.uri"
                )
        except CheckpointError as error:
            self._fail(step, str(error))
            return None
        except (TypeError, ValueError, KeyError) as error:  # a malformed report must not stop the driver
            self._fail(step, f"the reports of step {step} cannot form a manifest: {type(error).__name__}: {error}")
            return None
        self.committed_steps.append(step)
        log.info("committed checkpoint step %d under %s (%d bytes)", step, self.storage.uri, manifest.total_bytes)
        try:
            self.last_retention = apply_retention(self.storage, keep_last=self.keep_last, keep_every=self.keep_every)
        except CheckpointError as error:  # old checkpoints stay a little longer; the next commit retries
            log.warning("checkpoint retention under %s failed: %s", self.storage.uri, error)
        return manifest

    def _fail(self, step: int, reason: str, *, cause: str = "storage") -> None:
        self.failed_steps[step] = reason
        log.warning("checkpoint step %d not committed: %s", step, reason)
        if self._on_failure is not None:
            self._on_failure(step, reason, cause)
