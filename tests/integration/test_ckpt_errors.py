"""Storage and checkpoint mistakes a user makes: one clear line each, exit 2, never a secret."""

from __future__ import annotations

import socket

import pytest
import torch

from checkpointing.commit import CommitCoordinator
from checkpointing.errors import (
    ForeignCheckpointError,
    StorageCredentialsError,
    StorageNotFoundError,
    StorageUnreachableError,
)
from checkpointing.reader import load_manifest, restore
from checkpointing.storage import open_storage
from checkpointing.writer import CheckpointWriter
from orchestrator.cli import main


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["ckpt", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_clean(text: str, *secrets: str) -> None:
    assert "Traceback" not in text
    for secret in secrets:
        assert secret not in text


def test_wrong_secret_key(s3_bucket, monkeypatch, capsys):
    wrong = "not-the-secret-" + "x" * 20
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    code, text = run_cli(capsys, "ls", s3_bucket.uri, "--endpoint-url", s3_bucket.endpoint_url)
    assert code == 2
    assert "the secret key does not match the access key" in text
    assert "AWS_SECRET_ACCESS_KEY" in text  # the fix is named
    assert_clean(text, wrong, s3_bucket.server.secret_key, s3_bucket.server.access_key)
    assert text.count("\n") == 1


def test_unknown_access_key(s3_bucket, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY123456")
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    with pytest.raises(StorageCredentialsError, match="the access key is not known"):
        storage.list()
    code, text = run_cli(capsys, "ls", s3_bucket.uri, "--endpoint-url", s3_bucket.endpoint_url)
    assert code == 2 and "access key is not known" in text
    assert_clean(text, "AKIAUNKNOWNKEY123456", s3_bucket.server.secret_key)


def test_no_credentials(s3_bucket, monkeypatch, tmp_path, capsys):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, text = run_cli(capsys, "ls", s3_bucket.uri, "--endpoint-url", s3_bucket.endpoint_url)
    assert code == 2 and "no complete AWS credentials found" in text


def test_missing_bucket(s3_bucket, capsys):
    uri = "s3://no-such-bucket-here/run"
    code, text = run_cli(capsys, "ls", uri, "--endpoint-url", s3_bucket.endpoint_url)
    assert code == 2
    assert "bucket 'no-such-bucket-here' does not exist" in text and "checkpoint.uri" in text
    storage = open_storage(uri, endpoint_url=s3_bucket.endpoint_url)
    with pytest.raises(StorageNotFoundError):
        storage.exists("step-00000001/manifest.json")  # a HEAD's bare 404 is told apart from a missing key
    assert_clean(text, s3_bucket.server.secret_key)


def test_unreachable_endpoint(s3_bucket, capsys):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    code, text = run_cli(capsys, "ls", s3_bucket.uri, "--endpoint-url", endpoint)
    assert code == 2
    assert f"cannot reach the S3 endpoint {endpoint}" in text and "--endpoint-url" in text
    storage = open_storage(s3_bucket.uri, endpoint_url=endpoint)
    with pytest.raises(StorageUnreachableError):
        storage.put_bytes("x", b"1")
    assert_clean(text, s3_bucket.server.secret_key)


def test_writer_reports_failure_instead_of_raising(s3_bucket, monkeypatch):
    """Upload failures are retried, then reported; training is not interrupted and nothing commits."""
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + "y" * 30)
    broken = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    coordinator = CommitCoordinator(broken, world_size=1, mesh={}, config_hash=None, model={}, keep_last=1)
    reports = []
    writer = CheckpointWriter(
        broken,
        rank=0,
        report=lambda r: (reports.append(r), coordinator.on_report(r)),
        upload_attempts=2,
        retry_backoff_s=0.01,
    )
    stall = writer.save(5, {"w": torch.ones(4)}, extra={}, owns_plain_tensors=True)
    assert stall < 5
    writer.close()
    assert [r.kind for r in reports] == ["failure"]
    assert "secret key does not match" in reports[0].error and reports[0].attempts == 2
    assert 5 in coordinator.failed_steps and coordinator.committed_steps == []
    assert storage.list() == []


def test_foreign_checkpoint_is_refused(s3_bucket, capsys):
    storage = open_storage(s3_bucket.uri, endpoint_url=s3_bucket.endpoint_url)
    coordinator = CommitCoordinator(
        storage, world_size=1, mesh={}, config_hash="aaaa", model={"dim": 64, "n_layers": 2}, keep_last=1
    )
    writer = CheckpointWriter(storage, rank=0, report=coordinator.on_report)
    writer.save(1, {"w": torch.ones(4)}, extra={}, owns_plain_tensors=True)
    writer.close()
    manifest = load_manifest(storage)
    with pytest.raises(ForeignCheckpointError, match=r"another model \(dim: checkpoint 64 vs job 128\)"):
        restore(storage, manifest, {"w": torch.zeros(4)}, model={"dim": 128, "n_layers": 2})
    with pytest.raises(ForeignCheckpointError, match="another config"):
        restore(storage, manifest, {"w": torch.zeros(4)}, config_hash="bbbb")
    with pytest.raises(ForeignCheckpointError, match=r"tensor 'w' has shape \[4\], this job's has \[5\]"):
        restore(storage, manifest, {"w": torch.zeros(5)})
    with pytest.raises(ForeignCheckpointError, match="has no tensor v"):
        restore(storage, manifest, {"v": torch.zeros(4)})
    code, text = run_cli(
        capsys, "export", s3_bucket.uri, "--endpoint-url", s3_bucket.endpoint_url, "--out", "/tmp/x-none"
    )
    assert code == 2 and "not a meshpilot Llama-style model" in text
