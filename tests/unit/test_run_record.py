"""Where a run's record goes: a submitted job's outlives the job, a bad location is one error."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.driver.run_record import record_location
from orchestrator.errors import ConfigError
from tests.jobs import DEMO_CONFIG, REPO


@pytest.fixture
def config(monkeypatch):
    monkeypatch.chdir(REPO)

    def build(*overrides: str):
        return load_config(DEMO_CONFIG, list(overrides))

    return build


def test_a_submitted_job_with_s3_checkpoints_mirrors_beside_them(config):
    job = config("checkpoint.uri=s3://bucket/ckpt/nightly/")
    location = record_location(job, None, in_ray_job=True)
    assert location.local_dir.parent == Path("runs") and location.local_dir.name.startswith("tiny-3d-")
    assert location.mirror_uri == f"s3://bucket/ckpt/nightly/runs/{location.local_dir.name}"
    assert location.warning is None
    assert record_location(job, None, in_ray_job=False).mirror_uri is None  # a laptop keeps runs/


def test_a_submitted_job_without_a_lasting_place_is_warned_with_the_key_to_set(config):
    location = record_location(config("checkpoint.uri=/tmp/ckpt"), None, in_ray_job=True)
    assert location.mirror_uri is None
    assert location.warning is not None
    assert "lies in the Ray job's working directory, which Ray deletes with the job" in location.warning
    assert "set runtime.run_dir (or --run-dir) to s3://BUCKET/PREFIX" in location.warning
    assert record_location(config(), "/shared/runs/a", in_ray_job=True).warning is None  # a shared path


def test_a_run_dir_uri_is_mirrored_and_the_argument_wins_over_the_key(config):
    job = config("runtime.run_dir=s3://bucket/records/a")
    assert record_location(job, None, in_ray_job=False).mirror_uri == "s3://bucket/records/a"
    location = record_location(job, "s3://other/b/", in_ray_job=False)
    assert location.mirror_uri == "s3://other/b" and location.local_dir.parent == Path("runs")
    assert record_location(job, "file:///shared/x", in_ray_job=False).local_dir == Path("/shared/x")
    with pytest.raises(ConfigError, match=r"--run-dir='s3://': no bucket; write s3://BUCKET/PREFIX"):
        record_location(job, "s3://", in_ray_job=False)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--run-dir", "s3://"], "invalid config: --run-dir='s3://': no bucket; write s3://BUCKET/PREFIX"),
        (["--set", "runtime.run_dir=s3:/bucket/x"], "runtime.run_dir='s3:/bucket/x': write s3://BUCKET/PREFIX"),
        (["--set", "runtime.run_dir=gs://b/x"], "runtime.run_dir='gs://b/x': scheme 'gs' is not supported"),
        (["--set", "runtime.run_dir_sync_s=0"], "runtime.run_dir_sync_s=0.0 must be > 0"),
    ],
)
def test_a_bad_run_dir_is_one_error_and_exit_2(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    assert main(["train", str(DEMO_CONFIG), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
