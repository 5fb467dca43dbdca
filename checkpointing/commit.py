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
background and its steps still commit, each with the mesh that saved it. So do the steps of a
mesh that lost ranks while a whole replica of the model survived (an in-place shrink): the lost
ranks are excused, and a step commits once the survivors reported, if their slices tile every
tensor (the lost ranks were other replicas' copies, which are not written); if they do not,
the lost ranks held slices nobody else wrote and the step fails as interrupted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
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
class _OldMesh:
    """A mesh that paused after ``last_step`` (``lost`` empty: every rank alive), or that lost
    ``lost`` ranks with a whole replica surviving: its survivors' saves may still report."""

    last_step: int
    world_size: int
    mesh: dict[str, Any]
    lost: frozenset[int] = frozenset()

    def awaits(self, reported: Iterable[int]) -> bool:
        """Whether a rank that can still report has not reported yet."""
        return bool(set(range(self.world_size)) - self.lost - set(reported))


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
        self._old_meshes: list[_OldMesh] = []  # oldest first
        self.committed_steps: list[int] = []
        self.failed_steps: dict[int, str] = {}
        self.last_retention: RetentionResult | None = None

    @property
    def pending_steps(self) -> list[int]:
        return sorted(self._pending)

    def reset(
        self,
        *,
        world_size: int,
        mesh: dict[str, Any],
        paused_after: int | None = None,
        lost: frozenset[int] = frozenset(),
    ) -> list[Manifest]:
        """The mesh changed (shrink, grow, restore); returns the manifests this committed.

        ``paused_after=S``: the old mesh's ranks that are not ``lost`` finish their uploads in
        the background, so its steps (up to S) still commit with the old mesh: a pause with
        every rank alive (``lost`` empty), or an in-place shrink where a whole replica survived
        (the caller's promise: each lost rank's tensors are held by a survivor). Steps already
        reported by every survivor commit now. Otherwise (no whole replica survived, or a restore
        rewinds) half-reported steps of every earlier mesh fail.
        """
        if (paused_after is None or lost) and self._old_meshes:
            # Earlier meshes' ranks are numbered differently: which of them are lost is unknown.
            earlier = self._old_meshes[-1].last_step
            self._fail_pending(lambda step: step <= earlier)
            self._old_meshes.clear()
        if paused_after is None:
            self._fail_pending(lambda step: True)
        else:
            self._fail_pending(lambda step: step > paused_after)  # saved after the pause: never complete
            self._old_meshes.append(_OldMesh(paused_after, self.world_size, self.mesh, lost))
        self.world_size = world_size
        self.mesh = dict(mesh)
        return [manifest for step in self.pending_steps if (manifest := self._commit_if_complete(step)) is not None]

    def _fail_pending(self, which: Callable[[int], bool]) -> None:
        for step in [step for step in self._pending if which(step)]:
            del self._pending[step]
            self._fail(step, MESH_CHANGED, cause="interrupted")

    def _mesh_of(self, step: int) -> _OldMesh:
        """The mesh that saved ``step``: an old one, or the current one (nobody lost)."""
        for old in self._old_meshes:
            if step <= old.last_step:
                return old
        return _OldMesh(step, self.world_size, self.mesh)

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
        world_size = self._mesh_of(step).world_size
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
        self._pending.setdefault(step, {})[parsed.rank] = parsed
        return self._commit_if_complete(step)

    def _commit_if_complete(self, step: int) -> Manifest | None:
        saved_by = self._mesh_of(step)
        if saved_by.awaits(self._pending[step]):
            return None
        reports = list(self._pending.pop(step).values())
        world_size, mesh = saved_by.world_size, saved_by.mesh
        if saved_by.lost and not _tiles_every_tensor(reports):
            self._fail(step, MESH_CHANGED, cause="interrupted")  # a lost rank held slices nobody else wrote
            return None
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


def _tiles_every_tensor(reports: list[ShardReport]) -> bool:
    """Whether the reported slices cover every tensor the reports name (replicas' copies counted once)."""
    shapes = {tensor.fqn: tensor.shape for report in reports for tensor in report.tensors}
    slices = {(chunk.fqn, chunk.offsets, chunk.sizes) for report in reports for chunk in report.chunks}
    covered = dict.fromkeys(shapes, 0)
    for fqn, _, sizes in slices:
        covered[fqn] = covered.get(fqn, 0) + math.prod(sizes)
    return all(covered[fqn] == math.prod(shape) for fqn, shape in shapes.items())
