"""``meshpilot submit`` / ``meshpilot jobs`` against a real Ray head with token authentication.

    python -m pytest tests/integration/test_submit.py -q

One head per module (``ray start --head --block`` with RAY_AUTH_MODE=token, every port free and
on loopback, its own temp dir and HOME), stopped through its process group even when a test
fails; ``ray stop`` is not used because it stops every Ray process on the machine.

The plumbing tests ship a small project whose ``orchestrator/cli.py`` stands in for meshpilot:
the entrypoint runs ``python -m orchestrator.cli train ...`` in the shipped directory, so the
stand-in prints exactly what the train command would receive (argv, shipped files) and joins the
cluster the way train does (``ray.init()`` reading RAY_ADDRESS). ``test_real_train_job_resumes``
ships this repository and runs the real ``meshpilot train``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SUBMISSION_ID = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)-\d{8}-\d{6}-[0-9a-f]{6}$")
NUM_CPUS = 4


@dataclass
class Head:
    address: str
    env: dict[str, str]
    token: str
    temp_dir: Path


def _free_port(*, avoid: range = range(10002, 20000)) -> int:
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:  # Ray's worker ports; --metrics-export-port must lie outside (FACTS.md)
            return port


def _clean_env(home: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_") and key not in ("PYTHONPATH",)}
    env.update(
        HOME=str(home),
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def _stop_process_group(process: subprocess.Popen, temp_dir: Path) -> None:
    """SIGTERM the head's process group, SIGKILL what is left, then any job driver still in our temp dir."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)  # `ray start` made itself the group leader; Ray's daemons follow it
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    # Job drivers run in their own session (Ray starts them with start_new_session); they are
    # ours when they run in the working directory Ray unpacked under our temp dir.
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd").startswith(str(temp_dir)):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue


@pytest.fixture(scope="module")
def ray_head():
    # A short path: Ray's unix sockets live under the temp dir and have a length limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="mp-ray-", dir="/tmp"))
    home = temp_dir / "home"
    home.mkdir()
    token = os.urandom(16).hex()
    token_file = temp_dir / "auth_token"
    token_file.write_text(token)
    env = _clean_env(home)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    dashboard_port = _free_port()
    ray_bin = Path(sys.executable).parent / "ray"
    command = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        f"--temp-dir={temp_dir / 'ray'}",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--num-cpus={NUM_CPUS}",
        f"--port={_free_port()}",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        "--disable-usage-stats",
    ]
    log_path = temp_dir / "head.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_ready(address, token, process, log_path)
        yield Head(address=address, env=env, token=token, temp_dir=temp_dir)
    finally:
        _stop_process_group(process, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_ready(address: str, token: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the head's dashboard did not answer within {timeout_s} s:\n{log_path.read_text()[-3000:]}")


def meshpilot(*args: str, env: dict[str, str], timeout: float = 180.0) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, from this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def stub_project(ray_head):
    """A project to ship: a config, a stand-in for the train command, files that must stay home."""
    root = ray_head.temp_dir / "project"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "tiny.yaml").write_text(
        textwrap.dedent("""\
        name: stubjob
        data: {source: synthetic}
        parallelism: {dp_shard: 1, tp: 1, pp: 1}
        checkpoint: {uri: "s3://bucket/ckpts"}
    """)
    )
    (root / "orchestrator").mkdir()
    (root / "orchestrator" / "__init__.py").write_text("")
    (root / "orchestrator" / "cli.py").write_text(
        textwrap.dedent("""\
        import json, os, sys, time
        print("STUB argv=" + json.dumps(sys.argv[1:]), flush=True)
        shipped = sorted(os.path.relpath(os.path.join(d, f)) for d, _, fs in os.walk(".") for f in fs)
        print("STUB files=" + json.dumps(shipped), flush=True)
        if 'name="stubjob"' in sys.argv:  # joining the cluster is proved once; it costs ~3 s a job
            import ray
            ray.init()  # RAY_ADDRESS, set by Ray in a job, and the token from the cluster's environment
            print("STUB cpus=%d" % ray.cluster_resources()["CPU"], flush=True)
        for arg in sys.argv:
            if arg.startswith("training.steps="):
                print("STUB sleeping", flush=True)
                time.sleep(int(arg.split("=")[1]))
    """)
    )
    for kept_home in ("runs/old/events.jsonl", ".venv/bin/python", ".git/HEAD"):
        (root / kept_home).parent.mkdir(parents=True, exist_ok=True)
        (root / kept_home).write_text("not shipped\n")
    (root / "data").mkdir()
    (root / "data" / "blob.bin").write_bytes(os.urandom(2 * 2**20))
    return root


def _stub_lines(output: str, key: str) -> list:
    return [json.loads(line.split("=", 1)[1]) for line in output.splitlines() if line.startswith(f"STUB {key}=")]


def _assert_no_secret(result: subprocess.CompletedProcess, secret: str) -> None:
    assert secret not in result.stdout and secret not in result.stderr


def test_submit_follow_status_logs(ray_head, stub_project):
    config = stub_project / "configs" / "tiny.yaml"
    submitted = meshpilot(
        "submit",
        str(config),
        "--working-dir",
        str(stub_project),
        "--address",
        ray_head.address,
        "--max-file-mb",
        "1",
        "--follow",
        env=ray_head.env,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.splitlines()[0]
    assert SUBMISSION_ID.match(job_id).group("name") == "stubjob"
    assert _stub_lines(submitted.stdout, "argv") == [
        [
            "train",
            "configs/tiny.yaml",
            "--set",
            'name="stubjob"',
            "--set",
            'checkpoint.uri="s3://bucket/ckpts/stubjob"',
            "--set",
            "checkpoint.resume=true",
        ]
    ]
    assert _stub_lines(submitted.stdout, "files") == [
        ["configs/tiny.yaml", "orchestrator/__init__.py", "orchestrator/cli.py"]
    ]
    assert f"STUB cpus={NUM_CPUS}" in submitted.stdout
    assert "not shipping 1 file(s) over 1 MiB: data/blob.bin" in submitted.stderr
    assert submitted.stderr.rstrip().endswith(f"meshpilot: {job_id}: SUCCEEDED")
    _assert_no_secret(submitted, ray_head.token)

    status = meshpilot("jobs", "status", job_id, "--address", ray_head.address, env=ray_head.env)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == f"{job_id}: SUCCEEDED  name=stubjob"

    logs = meshpilot("jobs", "logs", job_id, "--address", ray_head.address, env=ray_head.env)
    assert logs.returncode == 0, logs.stderr
    assert f"STUB cpus={NUM_CPUS}" in logs.stdout and "STUB argv=" in logs.stdout

    listing = meshpilot("jobs", "list", "--address", ray_head.address, env=ray_head.env)
    assert f"{job_id}  SUCCEEDED  stubjob" in listing.stdout.splitlines()


@pytest.mark.slow  # CI's tier
def test_resubmitting_a_name_keeps_its_checkpoint_location(ray_head, stub_project):
    config = stub_project / "configs" / "tiny.yaml"
    job_ids, argvs = [], []
    for _ in range(2):
        submitted = meshpilot(
            "submit",
            str(config),
            "--working-dir",
            str(stub_project),
            "--name",
            "again",
            "--address",
            ray_head.address,
            "--max-file-mb",
            "1",
            "--follow",
            env=ray_head.env,
        )
        assert submitted.returncode == 0, submitted.stderr
        job_ids.append(submitted.stdout.splitlines()[0])
        argvs += _stub_lines(submitted.stdout, "argv")
    assert job_ids[0] != job_ids[1]
    assert all(SUBMISSION_ID.match(job_id).group("name") == "again" for job_id in job_ids)
    assert argvs[0] == argvs[1]
    assert 'checkpoint.uri="s3://bucket/ckpts/again"' in argvs[0]


@pytest.mark.slow  # CI's tier
def test_stop_a_running_job_and_refuse_a_second_writer(ray_head, stub_project):
    config = stub_project / "configs" / "tiny.yaml"
    common = ["--working-dir", str(stub_project), "--address", ray_head.address, "--max-file-mb", "1"]
    submitted = meshpilot(
        "submit", str(config), "--name", "sleeper", "--set", "training.steps=300", *common, env=ray_head.env
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    duplicate = meshpilot("submit", str(config), "--name", "sleeper", *common, env=ray_head.env)
    assert duplicate.returncode == 2
    assert re.search(
        rf"meshpilot: a job named 'sleeper' is still (PENDING|RUNNING) as {job_id}: stop it first", duplicate.stderr
    )

    _wait_for_log(ray_head, job_id, "STUB sleeping")
    stopped = meshpilot("jobs", "stop", job_id, "--wait", "--address", ray_head.address, env=ray_head.env)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines() == [f"{job_id}: stop requested", f"{job_id}: STOPPED"]
    status = meshpilot("jobs", "status", job_id, "--address", ray_head.address, env=ray_head.env)
    assert status.stdout.splitlines()[0] == f"{job_id}: STOPPED  name=sleeper"
    again = meshpilot("jobs", "stop", job_id, "--address", ray_head.address, env=ray_head.env)
    assert again.stdout.strip() == f"{job_id}: already STOPPED, nothing to stop"


def _wait_for_log(head: Head, job_id: str, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in meshpilot("jobs", "logs", job_id, "--address", head.address, env=head.env).stdout:
            return
        time.sleep(1.0)
    raise AssertionError(f"{text!r} did not appear in the logs of {job_id}")


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("meshpilot: checkpoint.uri")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_errors_are_one_line_and_keep_the_token_secret(ray_head, stub_project):
    config = str(stub_project / "configs" / "tiny.yaml")
    no_token = {key: value for key, value in ray_head.env.items() if not key.startswith("RAY_AUTH")}
    line = _one_line_error(meshpilot("jobs", "list", "--address", ray_head.address, env=no_token))
    assert line == (
        f"meshpilot: the Ray cluster at {ray_head.address} requires a token (token authentication is on) "
        "and none was found: copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN"
    )

    wrong = "wrong-" + os.urandom(8).hex()
    result = meshpilot(
        "submit",
        config,
        "--working-dir",
        str(stub_project),
        "--address",
        ray_head.address,
        env={**no_token, "RAY_AUTH_TOKEN": wrong},
    )
    assert _one_line_error(result) == (
        f"meshpilot: the Ray cluster at {ray_head.address} rejected the token (from RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token): use the token the cluster was started with"
    )
    _assert_no_secret(result, wrong)

    unreachable = f"http://127.0.0.1:{_free_port()}"
    assert _one_line_error(meshpilot("jobs", "status", "x", "--address", unreachable, env=ray_head.env)) == (
        f"meshpilot: cannot reach the Ray dashboard at {unreachable}: is the head running and its dashboard port "
        "(8265 by default) reachable from here? Pass --address http://HEAD:8265"
    )

    assert _one_line_error(
        meshpilot("submit", "configs/missing.yaml", "--address", ray_head.address, env=ray_head.env)
    ) == ("meshpilot: config file 'configs/missing.yaml' does not exist; pass the path of a YAML job file")

    assert _one_line_error(
        meshpilot("jobs", "logs", "no-such-job", "--address", ray_head.address, env=ray_head.env)
    ) == (
        f"meshpilot: no job 'no-such-job' on the cluster at {ray_head.address}; "
        f"list them with: meshpilot jobs list --address {ray_head.address}"
    )


def _real_train(ray_head, *extra: str) -> subprocess.CompletedProcess:
    """``meshpilot submit configs/tiny-3d.yaml`` shipping this repository: 2 CPU ranks, tiny shapes."""
    return meshpilot(
        "submit",
        str(REPO_ROOT / "configs" / "tiny-3d.yaml"),
        "--address",
        ray_head.address,
        "--set",
        "parallelism.dp_shard=2",
        "--set",
        "parallelism.tp=1",
        "--set",
        "parallelism.pp=1",
        "--set",
        "training.warmup_steps=1",
        "--set",
        "training.seq_len=32",
        "--set",
        "training.global_batch=4",
        "--set",
        "parallelism.microbatches=1",
        "--set",
        "metrics.enabled=false",
        "--follow",
        *extra,
        env=ray_head.env,
        timeout=300,
    )


def test_real_train_job_runs_to_completion(ray_head):
    result = _real_train(ray_head, "--name", "real-train", "--set", "training.steps=3")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = result.stdout.splitlines()[0]
    assert SUBMISSION_ID.match(job_id).group("name") == "real-train"
    events = _events_of(ray_head, job_id)
    assert [event["step"] for event in events if event["event"] == "step"] == [1, 2, 3]
    assert {event["world_size"] for event in events if event["event"] == "step"} == {2}
    assert [event["event"] for event in events][-1] == "done"
    assert result.stderr.rstrip().endswith(f"meshpilot: {job_id}: SUCCEEDED")


def _events_of(head: Head, job_id: str) -> list[dict]:
    """The events.jsonl the job wrote last; its run directory lies in the working directory Ray unpacked."""
    written = sorted((head.temp_dir / "ray").rglob("events.jsonl"), key=lambda path: path.stat().st_mtime)
    assert written, f"{job_id} wrote no events.jsonl under {head.temp_dir / 'ray'} (the unpacked working directory)"
    return [json.loads(line) for line in written[-1].read_text().splitlines() if line.strip()]
