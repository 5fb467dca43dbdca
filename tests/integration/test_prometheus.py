"""A real Prometheus server scrapes meshpilot's exporter and answers over its HTTP API.

The server runs the shipped deploy/prometheus/prometheus.yml and alert rules, with only the
intervals shortened to 1 s and the file_sd directory moved into a temp dir; it finds the
exporter through the target file the driver writes (metrics.targets_dir), as a user's would.
Prometheus 2.x makes a first sample queryable ~5-6 s after a scrape starts (FACTS.md), so
every query polls for up to 30 s.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from orchestrator.driver.run import run_training
from orchestrator.observe.metrics import MetricsExporter, build_metrics
from tests.fixtures.synthetic_events import CHECKPOINT_BYTES, synthetic_run
from workers.spec import PRESETS

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
SHIPPED_RULES = ROOT / "deploy" / "prometheus" / "meshpilot-rules.yml"
QUERY_TIMEOUT_S = 30.0


@dataclass
class Prometheus:
    url: str
    targets_dir: Path
    log_path: Path

    def query(self, expr: str) -> list[dict]:
        address = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(address, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def api(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as response:
            return json.load(response)["data"]

    def distinct_values(self, expr: str, start: float, end: float) -> list[float]:
        """The values ``expr`` (one series) took between start and end, each change once, in order."""
        address = f"{self.url}/api/v1/query_range?" + urllib.parse.urlencode(
            {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": "0.5"}
        )
        with urllib.request.urlopen(address, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        [series] = body["data"]["result"]
        values: list[float] = []
        for _, text in series["values"]:
            if not values or values[-1] != float(text):
                values.append(float(text))
        return values

    def wait_for_value(self, expr: str, expected: float) -> None:
        """Poll until ``expr`` gives exactly one sample equal to ``expected``."""
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if len(result) == 1 and float(result[0]["value"][1]) == expected:
                return
            time.sleep(0.5)
        targets = self.api("/api/v1/targets")["activeTargets"]
        pytest.fail(
            f"{expr} did not become {expected} within {QUERY_TIMEOUT_S:g} s; last answer {result}; "
            f"targets {[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}"
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run `make setup` (deploy/prometheus/install.sh installs it)")
    root = tmp_path_factory.mktemp("prometheus")
    targets_dir = root / "targets"
    targets_dir.mkdir()
    config = yaml.safe_load(SHIPPED_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(SHIPPED_RULES)]
    job = next(job for job in config["scrape_configs"] if job["job_name"] == "meshpilot")
    job["scrape_interval"] = "1s"
    job["file_sd_configs"][0]["files"] = [str(targets_dir / "*.json")]
    job["file_sd_configs"][0]["refresh_interval"] = "1s"
    job.pop("static_configs", None)
    config["scrape_configs"] = [job]  # Ray's job left out: other clusters on this machine are not ours
    config_path = root / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = root / "prometheus.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", targets_dir, log_path)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{server.url}/-/ready", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"prometheus did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.3)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_prometheus_sees_steps_checkpoints_and_the_mesh_after_a_recovery(prometheus):
    exporter = MetricsExporter(
        model=PRESETS["debug"],
        seq_len=128,
        world_size=8,
        min_world_size=4,
        checkpoint_interval_steps=10,
        run_name="synthetic-feed",
        targets_dir=prometheus.targets_dir,
    )
    exporter.start_server("127.0.0.1", 0)
    events = synthetic_run(start_time=time.time())
    before_failure = next(i for i, e in enumerate(events) if e["event"] == "failure")
    after_recovery = next(i for i, e in enumerate(events) if e["event"] == "recovered") + 1
    run = '{run="synthetic-feed"}'
    try:
        for event in events[:before_failure]:
            exporter.on_event(event)
        prometheus.wait_for_value(f"meshpilot_steps_total{run}", 23)
        prometheus.wait_for_value(f"meshpilot_checkpoint_bytes_total{run}", 2 * CHECKPOINT_BYTES)
        prometheus.wait_for_value(f"meshpilot_world_size{run}", 8)
        prometheus.wait_for_value('up{job="meshpilot", run="synthetic-feed"}', 1)

        for event in events[before_failure:after_recovery]:
            exporter.on_event(event)
        prometheus.wait_for_value(f"meshpilot_world_size{run}", 4)
        prometheus.wait_for_value('meshpilot_mesh_degree{run="synthetic-feed", dim="dp_replicate"}', 1)
        prometheus.wait_for_value('meshpilot_failures_total{run="synthetic-feed", kind="actor_died"}', 1)
        prometheus.wait_for_value(f"meshpilot_recovery_seconds_count{run}", 1)
        prometheus.wait_for_value(f"meshpilot_recovery_seconds_sum{run}", 3.0)
    finally:
        exporter.close()
    assert list(prometheus.targets_dir.glob("*.json")) == []  # the target is withdrawn at exit


def test_the_shipped_alert_rules_evaluate_against_live_data(prometheus):
    exporter = MetricsExporter(world_size=2, run_name="rules-check", targets_dir=prometheus.targets_dir)
    exporter.start_server("127.0.0.1", 0)
    try:
        for event in synthetic_run(start_time=time.time(), steps=12):
            exporter.on_event(event)
        prometheus.wait_for_value('meshpilot_step{run="rules-check"}', 12)
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while True:
            rules = [rule for group in prometheus.api("/api/v1/rules")["groups"] for rule in group["rules"]]
            if rules and all(rule["health"] == "ok" for rule in rules) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert len(rules) == 8
        assert {rule["name"]: rule["health"] for rule in rules} == {rule["name"]: "ok" for rule in rules}
    finally:
        exporter.close()


class ServedPastTheRun:
    """The exporter ``run_training`` builds, serves and feeds, left serving when the run returns.

    Prometheus only learns of the last events at its next scrape; keeping the run's own
    exporter up a little longer lets the test ask at leisure instead of racing the exit.
    """

    def __init__(self, exporter: MetricsExporter) -> None:
        self.exporter = exporter

    def __getattr__(self, name: str):
        return getattr(self.exporter, name)

    def close(self) -> None:  # the test closes it once it has asked
        pass


def test_prometheus_scrapes_a_real_training_run(prometheus, ray_cluster, s3_bucket, tmp_path, monkeypatch):
    """Two replica groups of two ranks checkpoint to S3 every 2 steps; rank 3 is killed at step 4.

    Prometheus, finding the run through the target file its driver writes, must show the steps,
    the bytes of every committed checkpoint, and the mesh shrinking from 4 ranks to 2 with one
    failure and one recovery time, the same as events.jsonl says.
    """
    import orchestrator.driver.run as run_module
    from orchestrator.config import load_config
    from orchestrator.observe.events import checkpoint_failure_reason, read_events
    from tests.faults.harness import ELASTIC_LAYOUT
    from tests.jobs import DEMO_CONFIG, REPO
    from workers.faults import FaultSpec

    steps = 6
    config = load_config(
        DEMO_CONFIG,
        [
            f"data.path={REPO / 'data' / 'sample.txt'}",
            *ELASTIC_LAYOUT,
            "name=scraped-run",
            f"training.steps={steps}",
            f"checkpoint.uri={s3_bucket.uri}",
            f"checkpoint.endpoint_url={s3_bucket.endpoint_url}",
            "checkpoint.interval_steps=2",
            f"metrics.targets_dir={prometheus.targets_dir}",
        ],
    )
    served = ServedPastTheRun(build_metrics(config))
    monkeypatch.setattr(run_module, "build_metrics", lambda _config: served)
    began = time.time()
    try:
        result = run_training(config, tmp_path / "run", faults=(FaultSpec.parse("kill@4:3"),))
        assert result.exit_code == 0, result.reason
        assert served.port is not None  # run_training started it on metrics.host / metrics.port
        events = read_events(tmp_path / "run" / "events.jsonl")

        def of(kind: str) -> list[dict]:
            return [e for e in events if e["event"] == kind]

        commits = of("checkpoint_committed")
        [failure] = of("failure")
        [recovered] = of("recovered")
        assert failure["kind"] == "rank_died" and failure["ranks"] == [3]
        assert [e["step"] for e in of("step")] == list(range(1, steps + 1))
        assert commits and commits[-1]["step"] == steps and all(e["bytes"] > 0 for e in commits)
        assert all(e["uri"] == s3_bucket.uri for e in commits)
        grown = len(of("grow"))  # replacement actors may join before the end (not within 6 steps here)

        run = '{run="scraped-run"}'
        prometheus.wait_for_value('up{job="meshpilot", run="scraped-run"}', 1)
        prometheus.wait_for_value(f"meshpilot_steps_total{run}", steps)
        prometheus.wait_for_value(f"meshpilot_step{run}", steps)
        prometheus.wait_for_value(f"meshpilot_tokens_total{run}", steps * 16 * 64)
        prometheus.wait_for_value(f"meshpilot_loss{run}", of("step")[-1]["loss"])
        # checkpoints, as committed to the S3 bucket
        prometheus.wait_for_value(f"meshpilot_checkpoint_bytes_total{run}", sum(e["bytes"] for e in commits))
        prometheus.wait_for_value(f"meshpilot_checkpoints_committed_total{run}", len(commits))
        prometheus.wait_for_value(f"meshpilot_checkpoint_last_committed_step{run}", steps)
        prometheus.wait_for_value('meshpilot_checkpoint_failures_total{run="scraped-run", reason="storage"}', 0)
        interrupted = sum(1 for e in of("checkpoint_failed") if checkpoint_failure_reason(e) == "interrupted")
        prometheus.wait_for_value(
            'meshpilot_checkpoint_failures_total{run="scraped-run", reason="interrupted"}', interrupted
        )
        # the failure: one replica group left, the mesh went from 4 ranks to 2
        prometheus.wait_for_value('meshpilot_failures_total{run="scraped-run", kind="rank_died"}', 1)
        prometheus.wait_for_value(f"meshpilot_recoveries_total{run}", 1)
        prometheus.wait_for_value(f"meshpilot_recovery_seconds_count{run}", 1)
        prometheus.wait_for_value(f"meshpilot_recovery_seconds_sum{run}", recovered["mttr_s"])
        prometheus.wait_for_value(f"meshpilot_lost_steps_total{run}", 0)
        prometheus.wait_for_value(f"meshpilot_world_size{run}", 2 if not grown else 4)
        prometheus.wait_for_value('meshpilot_mesh_degree{run="scraped-run", dim="dp_replicate"}', 1 if not grown else 2)
        prometheus.wait_for_value('count(meshpilot_rank_step_time_seconds{run="scraped-run"})', 2 if not grown else 4)
        prometheus.wait_for_value(f"meshpilot_running{run}", 0)
        # what Prometheus recorded over the run: 4 ranks, then 2 after the failure
        history = prometheus.distinct_values(f"meshpilot_world_size{run}", began, time.time())
        assert history[:2] == [4.0, 2.0], history
        assert history == ([4.0, 2.0] if not grown else [4.0, 2.0, 4.0]), history
    finally:
        served.exporter.close()
    assert list(prometheus.targets_dir.glob("*.json")) == []  # the target is withdrawn at exit
