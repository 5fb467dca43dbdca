"""Fast checks of ``meshpilot submit``'s pieces (no cluster); tests/integration/test_submit.py runs them for real.

python -m pytest tests/unit/test_submit_cli.py -q
"""

from __future__ import annotations

import argparse
import datetime
import shlex
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import _get_excludes  # the matcher Ray packs working_dir with

from orchestrator.cli import submit as submit_cli
from orchestrator.config import JobConfig, load_config
from orchestrator.errors import UserError
from orchestrator.observe.redact import redact_text
from orchestrator.submission import auth, client, packaging


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "configs" / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_overrides_round_trip_through_the_train_side_loader(tmp_path):
    path = _config(
        tmp_path, "name: base\ndata: {source: synthetic}\ncheckpoint: {uri: 's3://bucket/prefix/', resume: false}\n"
    )
    config = load_config(path)
    # A name YAML would read as a number must stay a string on the cluster.
    overrides = packaging.job_overrides(config, name="1e3", user_overrides=["training.steps=7"])
    seen_by_train = load_config(path, overrides)
    assert seen_by_train.name == "1e3"
    assert seen_by_train.checkpoint.uri == "s3://bucket/prefix/1e3"
    assert seen_by_train.checkpoint.resume is True
    assert seen_by_train.training.steps == 7


def test_without_a_checkpoint_uri_only_the_name_is_set():
    assert packaging.job_overrides(JobConfig(), name="plain", user_overrides=[]) == ['name="plain"']


def test_entrypoint_is_one_shell_command_with_every_override():
    entrypoint = packaging.train_entrypoint(Path("configs/a b.yaml"), ['name="x"', "data.path=it's.txt"])
    assert shlex.split(entrypoint) == [
        "python",
        "-m",
        "orchestrator.cli",
        "train",
        "configs/a b.yaml",
        "--set",
        'name="x"',
        "--set",
        "data.path=it's.txt",
    ]


def test_submission_ids_are_unique_per_attempt_and_carry_the_name():
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    first, second = (packaging.submission_id_for("job.a", now=now) for _ in range(2))
    assert first != second
    assert first.startswith("job.a-20260102-030405-") and len(first) == len("job.a-20260102-030405-") + 6


@pytest.mark.parametrize("name", ["", "a/b", "-lead", "x" * 64, "sp ace", "../up"])
def test_bad_job_names_are_refused(name):
    with pytest.raises(UserError, match=r"use 1-63 letters, digits, '\.', '_' or '-'"):
        packaging.check_job_name(name)


def test_large_files_are_left_out_except_config_and_data(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big [1].bin").write_bytes(b"x" * 2048)
    (tmp_path / "data" / "corpus.txt").write_bytes(b"y" * 2048)
    (tmp_path / "small.txt").write_text("s")
    (tmp_path / ".venv" / "lib").mkdir(parents=True)
    (tmp_path / ".venv" / "lib" / "huge.so").write_bytes(b"z" * 4096)  # inside an excluded dir: never walked
    patterns, left_out = packaging.working_dir_excludes(
        tmp_path, max_file_bytes=1024, keep=[tmp_path / "data" / "corpus.txt", None]
    )
    assert left_out == ["data/big [1].bin"]
    excluded = _get_excludes(tmp_path, patterns)
    for path in (
        "data/big [1].bin",
        ".venv/lib/huge.so",
        "runs/x/events.jsonl",
        ".git/HEAD",
        "orchestrator/__pycache__/cli.cpython-311.pyc",
    ):
        assert excluded(tmp_path / path), path
    assert not excluded(tmp_path / "data" / "corpus.txt") and not excluded(tmp_path / "small.txt")


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("http://head:8265/", {}, "http://head:8265"),
        ("head:8265", {"RAY_ADDRESS": "http://other:1"}, "http://head:8265"),
        (None, {"RAY_API_SERVER_ADDRESS": "https://api:443", "RAY_ADDRESS": "http://other:1"}, "https://api:443"),
        (None, {"RAY_ADDRESS": "http://env:8265"}, "http://env:8265"),
    ],
)
def test_address_precedence(monkeypatch, flag, env, expected):
    for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert client.resolve_address(flag) == expected


def test_address_errors(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a GCS address is not the dashboard
    with pytest.raises(UserError, match=r"^no Ray cluster address: pass --address http://HEAD:8265"):
        client.resolve_address(None)
    with pytest.raises(UserError, match=r"that is a Ray Client address; jobs are submitted to the dashboard"):
        client.resolve_address("ray://head:10001")


@pytest.fixture
def token_loader(monkeypatch):
    from ray._raylet import AuthenticationTokenLoader

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()  # the loader caches the first token it finds, per process
    yield monkeypatch
    loader.reset_cache()


def test_token_from_the_environment_is_sent_and_masked(token_loader, tmp_path):
    token_loader.setenv("HOME", str(tmp_path))
    token_loader.setenv("RAY_AUTH_TOKEN", "s3cr3t-token-value")
    assert auth.auth_headers() == {"authorization": "Bearer s3cr3t-token-value"}
    assert redact_text("server said: s3cr3t-token-value") == "server said: ***"


def test_token_file_is_read_and_auth_mode_disabled_sends_nothing(token_loader, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file-123\n")
    token_loader.setenv("HOME", str(tmp_path))
    token_loader.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    assert auth.auth_headers() == {"authorization": "Bearer from-a-file-123"}
    token_loader.setenv("RAY_AUTH_MODE", "disabled")
    assert auth.auth_headers() == {}


def test_unreadable_token_path_is_one_clear_error(token_loader, tmp_path):
    token_loader.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "absent"))
    with pytest.raises(UserError) as caught:
        auth.auth_headers()
    assert str(caught.value) == (
        f"RAY_AUTH_TOKEN_PATH={tmp_path / 'absent'} is not a readable, non-empty file; point "
        "it at the cluster's token file (the head's ~/.ray/auth_token)"
    )


def test_no_token_anywhere_sends_no_header(token_loader, tmp_path):
    token_loader.setenv("HOME", str(tmp_path))
    assert auth.auth_headers() == {}


def _submit_args(config: Path, working_dir: Path) -> argparse.Namespace:
    return argparse.Namespace(
        config=str(config),
        address="http://127.0.0.1:9",
        name=None,
        overrides=[],
        follow=False,
        working_dir=str(working_dir),
        max_file_mb=64.0,
    )


def test_config_outside_the_working_dir_is_refused_before_any_request(tmp_path):
    config = _config(tmp_path / "elsewhere", "data: {source: synthetic}\n")
    (tmp_path / "project").mkdir()
    with pytest.raises(UserError, match=r"config '.*job.yaml' lies outside the working directory .*project"):
        submit_cli.submit_command(_submit_args(config, tmp_path / "project"))


def test_relative_data_outside_the_working_dir_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello " * 100)
    config = _config(tmp_path / "project", "data: {source: text, path: ../../corpus.txt}\n")
    with pytest.raises(UserError, match=r"data.path='../../corpus.txt' resolves to .*corpus.txt, outside the working"):
        submit_cli.submit_command(_submit_args(config, tmp_path / "project"))
