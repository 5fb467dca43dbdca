"""The driver side: commit once when every rank reported, never on failure, retention after commits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from checkpointing.catalog import list_committed, load_manifest
from checkpointing.commit import MESH_CHANGED, CommitCoordinator
from checkpointing.local import LocalStorage
from checkpointing.retention import steps_to_delete
from checkpointing.spec import FailureReport, ShardReport, manifest_key
from checkpointing.storage import StorageBackend
from checkpointing.writer import CheckpointWriter


def shard_reports(
    storage: StorageBackend, step: int, states: list[dict], owners: list[bool]
) -> list[ShardReport | FailureReport]:
    reports: list[ShardReport | FailureReport] = []
    for rank, (state, owns) in enumerate(zip(states, owners)):
        writer = CheckpointWriter(storage, rank=rank, report=reports.append)
        writer.save(step, state, extra={"step": step}, owns_plain_tensors=owns)
        writer.close()
    return reports


def coordinator(
    storage: StorageBackend,
    *,
    world_size: int = 2,
    keep_last: int = 2,
    keep_every: int = 0,
    on_failure: Callable[[int, str, str], None] | None = None,
) -> CommitCoordinator:
    return CommitCoordinator(
        storage,
        world_size=world_size,
        mesh={"dp_shard": 2},
        config_hash="h",
        model={"dim": 2},
        keep_last=keep_last,
        keep_every=keep_every,
        on_failure=on_failure,
    )


def test_commits_only_when_every_rank_reported(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage)
    first, second = shard_reports(storage, 5, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    assert coord.on_report(first) is None
    assert list_committed(storage) == [] and coord.pending_steps == [5]
    manifest = coord.on_report(second)
    assert manifest.step == 5 and set(manifest.tensors) == {"a", "b"}
    assert list_committed(storage) == [5]
    assert coord.on_report(second) is None  # a late duplicate changes nothing


def test_a_failure_report_means_no_commit(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    failures = []
    coord = coordinator(storage, on_failure=lambda step, reason, cause: failures.append((step, reason)))
    first, _ = shard_reports(storage, 6, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    coord.on_report({"kind": "failure", "step": 6, "rank": 1, "error": "disk full", "attempts": 3})
    assert coord.on_report(first) is None
    assert list_committed(storage) == []
    assert failures == [(6, "rank 1 gave up after 3 attempt(s): disk full")]


def test_a_tensor_nobody_wrote_is_not_committed(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage)
    state = {"a": torch.ones(2)}
    for report in shard_reports(storage, 7, [state, state], [False, False]):
        coord.on_report(report)
    assert list_committed(storage) == []
    assert "tensor 'a' is incomplete: its chunks hold 0 of 2 elements" in coord.failed_steps[7]


def test_identical_replicas_are_kept_once_and_diverged_ones_refused(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage)
    for report in shard_reports(storage, 8, [{"a": torch.ones(2)}, {"a": torch.ones(2)}], [True, True]):
        manifest = coord.on_report(report)
    assert len(manifest.tensors["a"].chunks) == 1
    for report in shard_reports(storage, 9, [{"a": torch.ones(2)}, {"a": torch.zeros(2)}], [True, True]):
        coord.on_report(report)
    assert "replicas of tensor 'a' at offsets [0] differ" in coord.failed_steps[9]


def test_an_existing_manifest_is_never_overwritten(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    storage.put_bytes(manifest_key(4), b"{}")
    coord = coordinator(storage, world_size=1)
    for report in shard_reports(storage, 4, [{"a": torch.ones(2)}], [True]):
        coord.on_report(report)
    assert storage.get(manifest_key(4)) == b"{}"
    assert "step 4 is already committed" in coord.failed_steps[4]


def test_retention_keeps_last_k_and_every_mth_and_clears_orphans(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage, world_size=1, keep_last=2, keep_every=20)
    storage.put_bytes("step-00000015/rank-00000-dead.safetensors", b"orphan of a failed save")
    for step in (10, 20, 30, 40, 50):
        for report in shard_reports(storage, step, [{"a": torch.full((2,), float(step))}], [True]):
            coord.on_report(report)
    assert list_committed(storage) == [20, 40, 50]
    steps_with_objects = sorted({info.key.split("/")[0] for info in storage.list()})
    assert steps_with_objects == ["step-00000020", "step-00000040", "step-00000050"]


def test_steps_to_delete():
    assert steps_to_delete([1, 2, 3, 4], keep_last=2) == [1, 2]
    assert steps_to_delete([10, 20, 30, 40, 50], keep_last=1, keep_every=20) == [10, 30]
    assert steps_to_delete([5], keep_last=3) == []


def test_mesh_change_drops_half_reported_steps(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage)
    first, _ = shard_reports(storage, 3, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    coord.on_report(first)
    coord.reset(world_size=1, mesh={"dp_shard": 1})
    assert coord.pending_steps == [] and "mesh changed" in coord.failed_steps[3]


def test_a_paused_meshs_uploads_commit_with_that_mesh_after_the_next_one_starts(tmp_path):
    """A grow pauses after step 4 without waiting for uploads: step 4's reports arrive once the
    bigger mesh runs, and step 4 commits with the two-rank mesh that saved it; step 6 needs the
    new mesh's four ranks."""
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage)
    old_mesh = shard_reports(storage, 4, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    coord.on_report(old_mesh[0])
    coord.reset(world_size=4, mesh={"dp_shard": 4}, paused_after=4)
    assert coord.on_report(old_mesh[1]) is not None
    assert coord.committed_steps == [4] and coord.failed_steps == {}
    assert load_manifest(storage, 4).mesh == {"dp_shard": 2}
    new_mesh = shard_reports(storage, 6, [{f"p{rank}": torch.ones(1)} for rank in range(4)], [True] * 4)
    assert [coord.on_report(report) is not None for report in new_mesh] == [False, False, False, True]
    assert load_manifest(storage, 6).mesh == {"dp_shard": 4} and load_manifest(storage, 6).world_size == 4


def test_a_failure_after_a_pause_fails_the_paused_meshs_half_reported_steps(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage)
    first, _ = shard_reports(storage, 4, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    coord.on_report(first)
    coord.reset(world_size=4, mesh={"dp_shard": 4}, paused_after=4)
    coord.reset(world_size=3, mesh={"dp_shard": 3})  # a rank lost: the paused mesh's saves end too
    assert coord.pending_steps == [] and "mesh changed" in coord.failed_steps[4]


def replicated_reports(storage: StorageBackend, step: int) -> list[ShardReport | FailureReport]:
    """Two replicas of two ranks (HSDP): replica 0 (ranks 0, 1) writes the slices, replica 1
    (ranks 2, 3) holds copies of them and writes none."""
    states = [{"a": torch.ones(2)}, {"b": torch.zeros(3)}] * 2
    return shard_reports(storage, step, states, [True, True, False, False])


def test_an_in_place_shrink_commits_a_save_without_the_lost_replicas_copies(tmp_path):
    """Replica 1's node is lost right after step 3 was staged, before its (empty) reports reached
    the driver: replica 0 wrote every slice, so step 3 commits with the mesh that saved it and
    stays there to restore from when the recovery itself meets a fault."""
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage, world_size=4)
    reports = replicated_reports(storage, 3)
    assert [coord.on_report(report) for report in reports[:2]] == [None, None]
    [committed] = coord.reset(world_size=2, mesh={"dp_shard": 2}, paused_after=4, lost=frozenset({2, 3}))
    assert committed.step == 3 and coord.committed_steps == [3] and coord.failed_steps == {}
    assert load_manifest(storage, 3).world_size == 4 and load_manifest(storage, 3).mesh == {"dp_shard": 2}
    assert coord.on_report(reports[2]) is None  # a lost rank's late report changes nothing
    new_mesh = shard_reports(storage, 6, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    assert [coord.on_report(report) is not None for report in new_mesh] == [False, True]


def test_survivors_reports_that_arrive_after_the_shrink_complete_the_save(tmp_path):
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage, world_size=4)
    reports = replicated_reports(storage, 3)
    assert coord.reset(world_size=2, mesh={"dp_shard": 2}, paused_after=3, lost=frozenset({3})) == []
    assert [coord.on_report(report) is not None for report in reports[:3]] == [False, False, True]
    assert load_manifest(storage, 3).world_size == 4


def test_a_save_whose_lost_rank_wrote_slices_fails_as_interrupted(tmp_path):
    """Rank 0 wrote tensor ``a`` and no survivor did: the step cannot commit."""
    storage = LocalStorage(tmp_path, fsync=False)
    failures: list[tuple[int, str, str]] = []
    coord = coordinator(storage, world_size=4, on_failure=lambda *failure: failures.append(failure))
    reports = replicated_reports(storage, 3)
    for report in reports[1:]:
        coord.on_report(report)
    assert coord.reset(world_size=2, mesh={"dp_shard": 2}, paused_after=3, lost=frozenset({0})) == []
    assert failures == [(3, MESH_CHANGED, "interrupted")] and coord.committed_steps == []
    assert coord.on_report(reports[0]) is None and list_committed(storage) == []


def test_saves_after_the_step_a_shrink_resumes_from_fail(tmp_path):
    """Survivors resume after step 3: a step-4 save some of them staged before the failure is
    never committed from the old mesh's reports (the new mesh redoes step 4)."""
    storage = LocalStorage(tmp_path, fsync=False)
    coord = coordinator(storage, world_size=4)
    coord.on_report(replicated_reports(storage, 4)[0])
    assert coord.reset(world_size=2, mesh={"dp_shard": 2}, paused_after=3, lost=frozenset({2})) == []
    assert coord.failed_steps == {4: MESH_CHANGED}


def test_a_step_redone_after_a_restore_commits_though_its_first_save_was_interrupted(tmp_path):
    """Generation 0 saved step 6 on one rank of two when a failure made the run restore an older
    step: that save fails, its late report changes nothing, and generation 1's save of step 6
    (the redo) commits."""
    storage = LocalStorage(tmp_path, fsync=False)
    failures: list[tuple[int, str, str]] = []
    coord = coordinator(storage, on_failure=lambda *failure: failures.append(failure))
    first_save = shard_reports(storage, 6, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    assert coord.on_report(first_save[0], generation=0) is None
    coord.reset(world_size=2, mesh={"dp_shard": 2}, generation=1)  # a restore rewinds
    assert failures == [(6, MESH_CHANGED, "interrupted")]
    assert coord.on_report(first_save[1], generation=0) is None
    redo = shard_reports(storage, 6, [{"a": torch.ones(2)}, {"b": torch.zeros(3)}], [True, True])
    assert [coord.on_report(report, generation=1) is not None for report in redo] == [False, True]
    assert coord.committed_steps == [6] and {f.key for f in load_manifest(storage, 6).files} == {
        f.key for report in redo for f in report.files
    }


def test_a_late_report_of_a_save_ended_by_a_mesh_change_fails_it_instead_of_joining_the_new_mesh(tmp_path):
    """No report of generation 0's step-3 save had arrived when the mesh changed: its late
    reports belong to no open mesh, so step 3 fails once (the new mesh does not count them)."""
    storage = LocalStorage(tmp_path, fsync=False)
    failures: list[tuple[int, str, str]] = []
    coord = coordinator(storage, world_size=4, on_failure=lambda *failure: failures.append(failure))
    late = replicated_reports(storage, 3)
    coord.reset(world_size=2, mesh={"dp_shard": 2}, generation=1)
    assert [coord.on_report(report, generation=0) for report in late[:2]] == [None, None]
    assert failures == [(3, MESH_CHANGED, "interrupted")] and coord.pending_steps == []


def test_driver_side_modules_do_not_import_torch():
    """The controller commits, lists and retains without torch (DESIGN.md import rules)."""
    import subprocess
    import sys

    code = (
        "import sys, checkpointing.commit, checkpointing.catalog, checkpointing.verify, "
        "checkpointing.local_s3, checkpointing.s3, orchestrator.cli.ckpt; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
