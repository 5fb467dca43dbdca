"""A run whose record goes to S3 (real SeaweedFS, real Ray): the mirrored copy is the local one,
byte for byte, and ``meshpilot report`` reads it from the URI."""

from __future__ import annotations

from checkpointing.storage import open_storage
from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.driver.run import run_training
from tests.jobs import DEMO_CONFIG, REPO, single_rank


def test_a_record_mirrored_to_s3_equals_the_local_one_and_reports(
    ray_cluster, s3_bucket, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # the local copy goes to runs/<name>-<timestamp> under the current directory
    uri = f"{s3_bucket.uri}/record"
    config = load_config(
        DEMO_CONFIG,
        [
            f"data.path={REPO / 'data' / 'sample.txt'}",
            *single_rank("training.steps=3", f"checkpoint.endpoint_url={s3_bucket.endpoint_url}"),
            "runtime.run_dir_sync_s=0.5",
        ],
    )
    result = run_training(config, uri)
    assert result.exit_code == 0 and result.record_uri == uri
    assert result.run_dir.parent.resolve() == tmp_path / "runs"

    storage = open_storage(uri, endpoint_url=s3_bucket.endpoint_url)
    local = result.run_dir
    assert storage.get("events.jsonl") == (local / "events.jsonl").read_bytes()
    assert storage.get("config.yaml") == (local / "config.yaml").read_bytes()
    uploaded = {info.key for info in storage.list()}
    assert {f"logs/{path.name}" for path in (local / "logs").iterdir()} <= uploaded
    assert not any(key.startswith("events.parts/") for key in uploaded)  # the whole file replaced them

    capsys.readouterr()
    assert main(["report", uri, "--endpoint-url", s3_bucket.endpoint_url]) == 0
    printed = capsys.readouterr().out
    assert "run tiny-3d: finished, step 3/3" in printed
    assert "timeline: timeline.png" in printed and (tmp_path / "timeline.png").stat().st_size > 0
