"""``meshpilot train`` as a user runs it: its own embedded cluster, Ctrl-C, placement errors, a
cluster whose nodes cannot start the ranks."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.support.ray_head import running_ray_cluster
from orchestrator.config import JobConfig, load_config
from orchestrator.driver.run import run_training
from orchestrator.errors import ConfigError, UserError
from orchestrator.observe.events import read_events
from tests.jobs import DEMO_CONFIG, REPO, signal_after_step, single_rank
from workers.actor import RankActor


def test_ctrl_c_stops_every_rank_and_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "train",
            str(DEMO_CONFIG),
            "--run-dir",
            str(run_dir),
            "--set",
            "training.steps=1000",
            "--set",
            "parallelism.pp=1",
            "--set",
            "parallelism.tp=1",
            "--plain",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = signal_after_step(process, run_dir, signal.SIGINT)
    assert process.returncode == 130, output
    assert "Traceback" not in output
    events = read_events(run_dir / "events.jsonl")
    done = events[-1]
    assert done["event"] == "done" and done["status"] == "interrupted"
    assert 1 <= done["steps"] < 1000
    assert (run_dir / "config.yaml").exists()
    assert f"run directory: {run_dir}" in output


def failed_run_error(config: JobConfig, run_dir: Path, error_type: type[Exception]) -> str:
    """The message of the ``error_type`` a run raises, once its record says it failed."""
    with pytest.raises(error_type) as raised:
        run_training(config, run_dir)
    assert json.loads((run_dir / "events.jsonl").read_text().splitlines()[-1])["status"] == "failed"
    return str(raised.value)


def test_more_ranks_than_the_cluster_can_place(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    message = failed_run_error(load_config(DEMO_CONFIG, ["runtime.cpus_per_rank=4"]), tmp_path, ConfigError)
    assert message == (
        "invalid config: parallelism: dp_replicate=1 x pp=2 x dp_shard=2 x tp=2 cannot be placed: "
        "8 ranks need 32 CPUs and 0 GPUs; the cluster has 16 CPUs and 0 GPUs; lower the degrees, "
        "elastic.spare_actors, runtime.cpus_per_rank / runtime.gpus_per_rank, or add nodes"
    )


class RankActorWithoutTorch(RankActor):
    """A rank actor on a node whose Python environment lacks torch: its constructor fails."""

    def __init__(self, **_: object) -> None:
        raise ModuleNotFoundError("No module named 'torch'")


def test_actors_that_cannot_start_give_one_error_naming_the_cause(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("orchestrator.driver.worker_group.RankActor", RankActorWithoutTorch)
    config = load_config(DEMO_CONFIG, ["parallelism.pp=1", "parallelism.tp=1", "parallelism.dp_shard=2"])
    assert failed_run_error(config, tmp_path, UserError) == (
        "runtime: an actor of the job could not start on the Ray cluster (ModuleNotFoundError: No module "
        "named 'torch'); every node's Python environment needs meshpilot's dependencies (torch, boto3, "
        "safetensors); the actor's own log is a worker-*.err file in the Ray session's logs/ directory"
    )


class Messages(logging.Handler):
    """Every message of a logger, whatever its propagation (the driver's logger does not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_an_actor_that_cannot_start_in_the_background_is_logged_once(ray_cluster, monkeypatch):
    import time

    from elastic.placement import RankResources
    from orchestrator.driver.train_spec import data_bytes, train_spec
    from orchestrator.driver.worker_group import WorkerGroup

    monkeypatch.setattr("orchestrator.driver.worker_group.RankActor", RankActorWithoutTorch)
    config = load_config(DEMO_CONFIG, ["parallelism.pp=1", "parallelism.tp=1", "parallelism.dp_shard=2"])
    group = WorkerGroup(
        spec=train_spec(config), data=data_bytes(config), per_rank=RankResources(0.5, 0.0, {}), start_timeout_s=60
    )
    logged = Messages()
    logging.getLogger("meshpilot").addHandler(logged)
    try:
        for _attempt in range(2):  # a grow retries: the same cause is not logged again
            assert group.start_replica_in_background(config.mesh)
            deadline = time.monotonic() + 60
            while group.starting() and time.monotonic() < deadline:
                assert group.refresh() == []
                time.sleep(0.1)
            assert group.starting() == [] and group.warm() == []
    finally:
        group.shutdown()
        logging.getLogger("meshpilot").removeHandler(logged)
    assert [message for message in logged.messages if "could not start" in message] == [
        "an actor started in the background could not start: ModuleNotFoundError: No module named 'torch'"
    ]


@pytest.mark.slow  # a second Ray head of its own (about 13 s); CI runs it
def test_train_joins_a_token_protected_cluster_by_its_address(tmp_path, monkeypatch):
    """Ray's default cluster wants its token; a shell that never set RAY_AUTH_MODE still joins
    with the token where Ray's clients look for it (the head keeps it in ~/.ray/auth_token)."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)  # a user's shell, for the head and the driver alike
    with running_ray_cluster(num_cpus=2) as address:
        process = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "train", str(DEMO_CONFIG), "--address", address]
            + ["--run-dir", str(tmp_path / "run"), "--plain"]
            + [f"--set={override}" for override in single_rank("training.steps=2", "metrics.enabled=false")]
            + [f"--set=data.path={REPO / 'data' / 'sample.txt'}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert process.returncode == 0, process.stderr[-2000:]
    assert [e["step"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "step"] == [1, 2]


@pytest.mark.slow
def test_train_joins_a_cluster_without_token_mode_from_a_machine_holding_a_token(ray_cluster, tmp_path):
    """A cluster started without token mode (the session's ``ray.cluster_utils.Cluster``, or
    ``RAY_AUTH_MODE=disabled ray start --head``) and a driver's machine holding a token (any
    embedded run writes ~/.ray/auth_token): the driver joins without token mode, or the cluster,
    refused by it, destroys its store and ranks before they start."""
    env = {
        **{name: value for name, value in os.environ.items() if name not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")},
        "RAY_ADDRESS": ray_cluster.address,
        "RAY_AUTH_TOKEN": "0123456789abcdef" * 2,
    }
    process = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "train", str(DEMO_CONFIG), "--run-dir", str(tmp_path / "run")]
        + ["--plain"]
        + [f"--set={override}" for override in single_rank("training.steps=1", "metrics.enabled=false")]
        + [f"--set=data.path={REPO / 'data' / 'sample.txt'}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]
    assert [e["step"] for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "step"] == [1]
