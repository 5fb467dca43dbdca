"""``meshpilot train`` as a user runs it: its own embedded cluster, Ctrl-C, placement errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from orchestrator.config import load_config
from orchestrator.driver.run import run_training
from orchestrator.errors import ConfigError
from orchestrator.observe.events import read_events
from tests.jobs import DEMO_CONFIG, REPO, signal_after_step


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


def test_more_ranks_than_the_cluster_can_place(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    config = load_config(DEMO_CONFIG, ["runtime.cpus_per_rank=4"])
    try:
        run_training(config, tmp_path)
    except ConfigError as error:
        message = str(error)
    else:
        raise AssertionError("an 8-rank job needing 32 CPUs was placed on a 16-CPU cluster")
    assert message == (
        "invalid config: parallelism: dp_replicate=1 x pp=2 x dp_shard=2 x tp=2 cannot be placed: "
        "8 ranks need 32 CPUs and 0 GPUs; the cluster has 16 CPUs and 0 GPUs; lower the degrees, "
        "elastic.spare_actors, runtime.cpus_per_rank / runtime.gpus_per_rank, or add nodes"
    )
    assert json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])["status"] == "failed"
