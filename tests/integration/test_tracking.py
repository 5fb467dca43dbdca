"""One real job tracked in a real MLflow server and in W&B's offline files: 10 steps, rank 3 killed at step 4.

    python -m pytest tests/integration/test_tracking.py -q -m slow

The translation of events, the queue, drops, retries and bad input are unit tests on recorded
event streams (tests/unit/test_tracking.py); this shows that both trackers hold what the run's
own events say, read back with their own API and files.
"""

from __future__ import annotations

import pytest

from tests.faults.harness import ELASTIC_LAYOUT, of_kind, run_job
from tests.fixtures.mlflow_server import MlflowServer
from tests.jobs import losses
from tests.wandb_files import read_finished_wandb_run

STEPS = 10


@pytest.fixture
def mlflow_server(tmp_path):
    pytest.importorskip("mlflow.server")
    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        yield server
    finally:
        server.stop()


# slow: a real job with a killed rank, and an MLflow server that takes 10-40 s to start (while the job runs);
# measured at about the time of the same job without tracking.
@pytest.mark.slow
def test_killed_rank_run_shows_its_loss_curve_and_recovery_in_mlflow_and_wandb(
    ray_cluster, mlflow_server, tmp_path, monkeypatch
):
    pytest.importorskip("wandb")
    from mlflow import MlflowClient

    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    # The server starts while the job runs; the tracker retries until it is up, and the end of
    # the run waits for it (close_timeout_s) rather than the test waiting before the run.
    result, events = run_job(
        run_dir,
        *ELASTIC_LAYOUT,
        f"training.steps={STEPS}",
        f"tracking.mlflow.tracking_uri={mlflow_server.uri}",
        "tracking.mlflow.experiment=killed-rank",
        "tracking.wandb.project=killed-rank",
        "tracking.wandb.mode=offline",
        "tracking.close_timeout_s=180",
        faults=("kill@4:3",),
    )
    assert result.exit_code == 0, result.reason
    expected = losses(events)
    assert sorted(expected) == list(range(1, STEPS + 1))
    [recovered] = of_kind(events, "recovered")
    # Markers sit at the last step completed before their event.
    recovery_step = max(e["step"] for e in events[: events.index(recovered)] if e["event"] == "step")

    # MLflow, through the server's REST API
    mlflow_server.wait_ready()
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("killed-rank")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == run_dir.name and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert len(history) == STEPS
    assert {m.step: m.value for m in history} == pytest.approx(expected)
    [marker] = client.get_metric_history(run.info.run_id, "recovered")
    assert (marker.step, marker.value) == (recovery_step, pytest.approx(recovered["mttr_s"]))
    [failure] = client.get_metric_history(run.info.run_id, "failure")
    assert failure.value == 1.0 and failure.step <= recovery_step
    assert run.data.params["training.steps"] == str(STEPS) and run.data.tags["meshpilot.status"] == "finished"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "events.jsonl", "logs"} <= artifacts

    # W&B, from the offline run's own file
    wandb_run = read_finished_wandb_run(run_dir)
    rows = wandb_run.history
    assert {row["step"]: row["loss"] for row in rows if "loss" in row} == pytest.approx(expected)
    assert [(row["step"], row["recovered"]) for row in rows if "recovered" in row] == [
        (recovery_step, pytest.approx(recovered["mttr_s"]))
    ]
    assert wandb_run.summary["meshpilot.status"] == "finished" and wandb_run.exit_code == 0
    assert wandb_run.config["training"]["steps"] == STEPS
    [record] = [paths for (kind, _), paths in wandb_run.artifacts.items() if kind == "run-record"]
    assert {"config.yaml", "events.jsonl", "logs/driver.jsonl"} <= set(record)
