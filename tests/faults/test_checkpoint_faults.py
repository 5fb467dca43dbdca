"""Faults that go through storage: no replica survives, S3 goes down, the driver dies or is
terminated, a single replica is drained, a replica's node is lost with a save in flight and a
second fault follows, a checkpoint is corrupt. Real Ray, real S3 (SeaweedFS with
authentication): after each, training resumes where an uninterrupted run would be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from checkpointing.catalog import list_committed
from checkpointing.storage import open_storage
from checkpointing.verify import verify_checkpoint
from orchestrator.observe.events import read_events
from tests.faults.harness import ELASTIC_LAYOUT, ON_WORKER_NODES, of_kind, run_job
from tests.fixtures.worker_nodes import WorkerNodes
from tests.jobs import DEMO_CONFIG, REPO, losses, signal_after_step

pytestmark = pytest.mark.slow

SINGLE_REPLICA = (
    "parallelism.dp_replicate=1",
    "parallelism.dp_shard=2",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "training.seq_len=32",
)
STEPS = 14


def checkpoints_to(bucket, interval: int = 2) -> tuple[str, ...]:
    return (
        f"checkpoint.uri={bucket.uri}",
        f"checkpoint.endpoint_url={bucket.endpoint_url}",
        f"checkpoint.interval_steps={interval}",
    )


@pytest.fixture(scope="module")
def reference(uninterrupted):
    # The same job as tests/faults/test_driver_adoption.py's reference: one run serves both.
    return uninterrupted(*SINGLE_REPLICA, f"training.steps={STEPS}")


def assert_resumed_like(events, reference, *, restored_step: int) -> None:
    """Steps after the restore are the uninterrupted run's steps, each exactly once from there."""
    after = [e for e in events[events.index(of_kind(events, "restored")[-1]) :] if e["event"] == "step"]
    assert [e["step"] for e in after] == list(range(restored_step + 1, STEPS + 1))
    for event in after:
        assert event["loss"] == pytest.approx(reference[event["step"]], rel=1e-4), f"step {event['step']}"
    assert events[-1]["event"] == "done" and events[-1]["status"] == "finished" and events[-1]["steps"] == STEPS


def committed_before(events, index: int) -> list[int]:
    return [e["step"] for e in events[:index] if e["event"] == "checkpoint_committed"]


def test_no_surviving_replica_without_snapshots_restores_the_latest_checkpoint(reference, s3_bucket, tmp_path):
    # Late enough that some save has committed on a loaded machine too: steps take ~0.15 s here,
    # and a rank's first upload (new S3 connections) once took longer than steps 2 to 6.
    # Peer-memory snapshots off: with them the state comes from memory (tests/faults/test_peer_memory.py).
    result, events = run_job(
        tmp_path,
        *SINGLE_REPLICA,
        f"training.steps={STEPS}",
        *checkpoints_to(s3_bucket),
        "elastic.snapshot_interval_steps=0",
        faults=("kill@12:1",),
    )
    assert result.exit_code == 0, result.reason
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [1]
    [restored] = of_kind(events, "restored")
    assert restored["step"] == max(committed_before(events, events.index(failure)))
    [recovered] = of_kind(events, "recovered")
    last_before = max(e["step"] for e in events[: events.index(failure)] if e["event"] == "step")
    assert recovered["cause"] == "restore" and recovered["lost_steps"] == last_before - restored["step"]
    assert_resumed_like(events, reference, restored_step=restored["step"])


def test_the_only_rank_killed_fires_its_fault_once(reference, s3_bucket, tmp_path):
    """Regression (first seen on a GPU, where steps are fast): a one-rank job runs ahead of the
    driver's polls, so a kill took the reports of the steps before it along; the driver took the
    failure for one of an earlier step, kept the fault armed and the redo was killed again, until
    the failure budget ended the run. A rank now dies only once the driver has its reports."""
    result, events = run_job(
        tmp_path,
        *SINGLE_REPLICA,
        "parallelism.dp_shard=1",
        f"training.steps={STEPS}",
        *checkpoints_to(s3_bucket, interval=3),
        "elastic.snapshot_interval_steps=0",
        faults=("kill@10:0",),
    )
    assert result.exit_code == 0, result.reason
    [failure] = of_kind(events, "failure")
    assert failure["kind"] == "rank_died" and failure["ranks"] == [0]
    # Every step before the kill reached the driver: the failure interrupted step 10.
    assert max(e["step"] for e in events[: events.index(failure)] if e["event"] == "step") == 9
    [restored] = of_kind(events, "restored")
    assert_resumed_like(events, reference, restored_step=restored["step"])


def test_s3_outage_during_uploads_never_stops_training(reference, s3_bucket, tmp_path):
    result, events = run_job(
        tmp_path, *SINGLE_REPLICA, f"training.steps={STEPS}", *checkpoints_to(s3_bucket), faults=("s3_outage@3:0",)
    )
    assert result.exit_code == 0, result.reason
    assert [e["step"] for e in of_kind(events, "step")] == list(range(1, STEPS + 1))
    assert losses(events) == pytest.approx(reference, rel=1e-4)
    failed = [e["step"] for e in of_kind(events, "checkpoint_failed")]
    committed = [e["step"] for e in of_kind(events, "checkpoint_committed")]
    assert failed, "the outage made no upload fail"
    assert committed and max(committed) > max(failed), "no checkpoint committed once storage came back"
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    assert not set(failed) & set(list_committed(storage)), "a failed upload became visible"
    assert verify_checkpoint(storage, max(committed)).problems == []  # raises on a bad object


def _train_command(run_dir, bucket, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "orchestrator.cli",
        "train",
        str(DEMO_CONFIG),
        "--run-dir",
        str(run_dir),
        "--plain",
        f"--set=data.path={REPO / 'data' / 'sample.txt'}",
        *[f"--set={o}" for o in SINGLE_REPLICA],
        f"--set=training.steps={STEPS}",
        *[f"--set={o}" for o in checkpoints_to(bucket)],
        *extra,
    ]


def _on_the_session_cluster(ray_cluster) -> dict[str, str]:
    """The environment of a ``meshpilot train`` process that joins the session's cluster (as a
    driver on a real cluster does) instead of starting and stopping an embedded one of its own:
    seconds per process, and the outcome is the driver's either way."""
    return {**os.environ, "RAY_ADDRESS": ray_cluster.address}


def test_driver_killed_and_restarted_resumes_from_storage(reference, s3_bucket, ray_cluster, tmp_path):
    env = _on_the_session_cluster(ray_cluster)
    first = subprocess.run(
        _train_command(tmp_path / "first", s3_bucket, "--inject", "driver@7"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    committed = list_committed(storage)
    assert committed and max(committed) <= 7
    second = subprocess.run(
        _train_command(tmp_path / "second", s3_bucket), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stdout + second.stderr
    events = read_events(tmp_path / "second" / "events.jsonl")
    [restored] = of_kind(events, "restored")
    assert restored["step"] == max(committed)
    assert_resumed_like(events, reference, restored_step=restored["step"])


def test_sigterm_on_the_driver_saves_at_the_step_boundary_then_stops(reference, s3_bucket, ray_cluster, tmp_path):
    env = _on_the_session_cluster(ray_cluster)
    run_dir = tmp_path / "first"
    process = subprocess.Popen(
        _train_command(run_dir, s3_bucket, "--set=checkpoint.interval_steps=1000"),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = signal_after_step(process, run_dir, signal.SIGTERM, step=4, wait_s=300, exit_s=300)
    assert process.returncode == 143, output
    events = read_events(run_dir / "events.jsonl")
    last_step = max(e["step"] for e in of_kind(events, "step"))
    assert events[-1]["status"] == "preempted"
    # the emergency checkpoint is the last step the run took: nothing to redo
    assert [e["step"] for e in of_kind(events, "checkpoint_committed")] == [last_step]
    second = subprocess.run(
        _train_command(tmp_path / "second", s3_bucket), cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stdout + second.stderr
    resumed = read_events(tmp_path / "second" / "events.jsonl")
    assert of_kind(resumed, "restored")[0]["step"] == last_step
    assert_resumed_like(resumed, reference, restored_step=last_step)


def test_a_save_in_flight_when_a_replicas_node_is_lost_commits_and_is_restored_after_a_second_fault(
    reference, s3_bucket, ray_cluster, tmp_path
):
    """Regression (chaos seed 2): replica 1's node goes away right after step 3 was saved, before
    its ranks' reports of that save reached the driver, and rank 0 dies while the shrunk mesh
    configures. No replica is whole then, and without peer-memory snapshots only storage is
    left: step 3 must have committed without replica 1, whose ranks write no slice (replica 0
    writes them all), and the run resumes from it."""
    nodes = WorkerNodes(ray_cluster, 2)
    try:
        result, events = run_job(
            tmp_path,
            *ELASTIC_LAYOUT,
            "training.seq_len=32",
            ON_WORKER_NODES,
            f"training.steps={STEPS}",
            *checkpoints_to(s3_bucket, interval=3),
            "elastic.snapshot_interval_steps=0",
            faults=("node@3:2", "kill@4:0/configure"),
            node_fault=nodes.remove,
        )
    finally:
        nodes.close()
    assert result.exit_code == 0, result.reason
    # On a loaded machine rank 0 may also be found stuck in the first failure (both replicas hit
    # then): the save must have committed all the same.
    node_lost, *later = of_kind(events, "failure")
    assert "node_lost" in node_lost["kind"] and {2, 3} <= set(node_lost["ranks"])
    assert any(failure["kind"] == "rank_died" and failure["ranks"] == [0] for failure in later)
    restores = of_kind(events, "restored")
    first_restore = events.index(restores[0])
    assert restores[0]["step"] == 3 and committed_before(events, first_restore) == [3]
    # Saves of the generations after the restore commit (each report names its generation).
    assert 6 in [e["step"] for e in events[first_restore:] if e["event"] == "checkpoint_committed"]
    assert_resumed_like(events, reference, restored_step=restores[-1]["step"])
