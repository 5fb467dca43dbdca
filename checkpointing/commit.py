"""``CommitCoordinator``: the driver side of a save — wait for every rank, then commit the manifest.

Runs on the driver (the controller), never on a rank; torch-free. The controller feeds it every
checkpoint upload report (``ShardReport`` or ``FailureReport``, frozen, ``checkpointing/spec.py``) that
reaches it from the ranks' ``CheckpointWriter``::

    coordinator = CommitCoordinator(storage, world_size=8, mesh=mesh_dict, config_hash=h,
                                    model=model_dict, keep_last=3, keep_every=0)
    manifest = coordinator.on_report(shard_report, generation=g)  # None until the step is complete
    if manifest: emit checkpoint_committed(step, uri, bytes, upload_s)
    coordinator.reset(world_size=4, mesh=new_mesh_dict, generation=g + 1, ...)  # the mesh changed

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

Reports carry the generation (mesh) that saved them: an upload that ends after a mesh change is
matched with its own mesh, a save ended by the change fails, and a later generation that redoes
a failed step (after a restore that rewinds) commits its save of it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
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
class _Saver:
    """The mesh of generation ``generation``, whose saves of steps up to ``last_step`` may still
    report: the current one (no limit), one that paused (``lost`` empty: every rank alive), or
    one that lost ``lost`` ranks with a whole replica surviving."""

    generation: int
    world_size: int
    mesh: dict[str, Any]
    last_step: float = math.inf
    lost: frozenset[int] = frozenset()

    def awaits(self, reported: Iterable[int]) -> bool:
        """Whether a rank that can still report has not reported yet."""
        return bool(set(range(self.world_size)) - self.lost - set(reported))


@dataclass
class _Save:
    """A save of one step in progress: the generation saving it and its ranks' reports so far."""

    generation: int
    reports: dict[int, ShardReport] = field(default_factory=dict)


@dataclass(frozen=True)
class _Failure:
    """Why the save of a step by ``generation`` failed (a later generation's redo may commit)."""

    generation: int
    reason: str


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
        generation: int = 0,
    ) -> None:
        self.storage = storage
        self._current = _Saver(generation, world_size, dict(mesh))
        self.config_hash = config_hash
        self.model = dict(model)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self._on_failure = on_failure
        self._pending: dict[int, _Save] = {}
        self._old_meshes: list[_Saver] = []  # oldest first
        self.committed_steps: list[int] = []
        self._failed: dict[int, _Failure] = {}
        self.last_retention: RetentionResult | None = None

    @property
    def pending_steps(self) -> list[int]:
        return sorted(self._pending)

    @property
    def failed_steps(self) -> dict[int, str]:
        """Why each failed step was not committed."""
        return {step: failure.reason for step, failure in self._failed.items()}

    def reset(
        self,
        *,
        world_size: int,
        mesh: dict[str, Any],
        generation: int | None = None,
        paused_after: int | None = None,
        lost: frozenset[int] = frozenset(),
    ) -> list[Manifest]:
        """The mesh changed (shrink, grow, restore) to ``generation`` (default: the next one);
        returns the manifests this committed.

        ``paused_after=S``: the old mesh's ranks that are not ``lost`` finish their uploads in
        the background, so its steps (up to S) still commit with the old mesh: a pause with
        every rank alive (``lost`` empty), or an in-place shrink where a whole replica survived
        (the caller's promise: each lost rank's tensors are held by a survivor). Steps already
        reported by every survivor commit now. Otherwise (no whole replica survived, or a restore
        rewinds) half-reported steps of every earlier mesh fail. A later generation's save of a
        failed step (a redo) commits as any other.
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
            self._old_meshes.append(replace(self._current, last_step=paused_after, lost=lost))
        next_generation = self._current.generation + 1 if generation is None else generation
        self._current = _Saver(next_generation, world_size, dict(mesh))
        return [manifest for step in self.pending_steps if (manifest := self._commit_if_complete(step)) is not None]

    def _fail_pending(self, which: Callable[[int], bool]) -> None:
        for step in [step for step in self._pending if which(step)]:
            self._fail(step, MESH_CHANGED, cause="interrupted", generation=self._pending.pop(step).generation)

    def _saver(self, generation: int | None, step: int) -> _Saver | None:
        """The mesh that saved ``step`` in ``generation``; None for a generation whose saves
        ended with a mesh change. Without a generation (one writer process per rank and no mesh
        change: tests, benchmarks), the one whose steps include ``step``."""
        for saver in (*self._old_meshes, self._current):
            if (generation is None or generation == saver.generation) and step <= saver.last_step:
                return saver
        return None

    def on_report(
        self, report: ShardReport | FailureReport | dict[str, Any], *, generation: int | None = None
    ) -> Manifest | None:
        """Record one rank's report of a save by ``generation``; return the manifest when this
        report completed a commit.

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
        saver = self._saver(generation, step)
        if step in self.committed_steps:
            return None
        saving = self._pending.get(step)
        if saver is None or saving is not None and saving.generation != saver.generation:
            # A late report of a save that a mesh change ended, or a save of a step another open
            # generation is saving: the step fails once, unless another generation is saving it.
            if generation is not None and step not in self._failed and saving is None:
                self._fail(step, MESH_CHANGED, cause="interrupted", generation=generation)
            return None
        failed = self._failed.get(step)
        if failed is not None and saver.generation <= failed.generation:
            return None  # that save failed; a later generation's redo of the step is taken
        if not 0 <= parsed.rank < saver.world_size:
            log.warning(
                "ignoring a checkpoint report of step %d from rank %d outside world size %d",
                step,
                parsed.rank,
                saver.world_size,
            )
            return None
        if isinstance(parsed, FailureReport):
            self._pending.pop(step, None)
            reason = f"rank {parsed.rank} gave up after {parsed.attempts} attempt(s): {parsed.error}"
            self._fail(step, reason, generation=saver.generation)
            return None
        self._pending.setdefault(step, _Save(saver.generation)).reports[parsed.rank] = parsed
        return self._commit_if_complete(step)

    def _commit_if_complete(self, step: int) -> Manifest | None:
        saving = self._pending[step]
        saved_by = self._saver(saving.generation, step)
        assert saved_by is not None, "a pending step's generation is open (reset fails the others)"
        if saved_by.awaits(saving.reports):
            return None
        reports = list(self._pending.pop(step).reports.values())
        world_size, mesh = saved_by.world_size, saved_by.mesh
        if saved_by.lost and not _tiles_every_tensor(reports):
            # A lost rank held slices nobody else wrote.
            self._fail(step, MESH_CHANGED, cause="interrupted", generation=saved_by.generation)
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
            self._fail(step, str(error), generation=saved_by.generation)
            return None
        except (TypeError, ValueError, KeyError) as error:  # a malformed report must not stop the driver
            reason = f"the reports of step {step} cannot form a manifest: {type(error).__name__}: {error}"
            self._fail(step, reason, generation=saved_by.generation)
            return None
        self.committed_steps.append(step)
        log.info("committed checkpoint step %d under %s (%d bytes)", step, self.storage.uri, manifest.total_bytes)
        try:
            self.last_retention = apply_retention(self.storage, keep_last=self.keep_last, keep_every=self.keep_every)
        except CheckpointError as error:  # old checkpoints stay a little longer; the next commit retries
            log.warning("checkpoint retention under %s failed: %s", self.storage.uri, error)
        return manifest

    def _fail(self, step: int, reason: str, *, generation: int, cause: str = "storage") -> None:
        self._failed[step] = _Failure(generation, reason)
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
