"""The shipped Prometheus files pass Prometheus's own checker and the alert rules' unit tests."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: run `make setup` (deploy/prometheus/install.sh installs it)")
    return subprocess.run([binary, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)


def test_scrape_config_is_valid():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: prometheus.yml is valid prometheus config file syntax" in result.stdout
    assert "SUCCESS: 8 rules found" in result.stdout  # the rule file it names is found and loads


def test_alert_rules_are_valid():
    result = promtool("check", "rules", "meshpilot-rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_alert_rules_fire_on_sick_runs_only():
    result = promtool("test", "rules", "tests/meshpilot-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_install_script_is_idempotent_when_prometheus_is_there():
    assert shutil.which("prometheus") and shutil.which("promtool"), "run `make setup` first"
    result = subprocess.run(["bash", str(PROMETHEUS_DIR / "install.sh")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout == "" and result.stderr == ""  # nothing to do, nothing said
