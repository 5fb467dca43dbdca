"""bench/gpu_check.py --smoke, as the lent GPU machine would run it but on this CPU: every part
present, each measured with sane figures or skipped with why, without Ray or boto3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.jobs import REPO

# Every process of the check (parent, parts, runs) starts with this on its path: every import
# finder then finds no Ray, boto3 or botocore, as on the lent machine, where they are not installed
# (``importlib.util.find_spec`` answers None, ``import ray`` raises ModuleNotFoundError).
BLOCKER = """
import sys

class _Without:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "boto3", "botocore"):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)

sys.meta_path[:] = [_Without(finder) for finder in sys.meta_path]
"""
PARTS = ("environment", "throughput", "memory", "checkpoint", "ray")


def run_smoke(tmp_path: Path, *extra: str, wheels: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    out = tmp_path / "out"
    argv = [sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(out), *extra]
    argv += [] if wheels else ["--no-wheels"]  # not the wheels a developer fetched into .gpu-wheels/
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300), out


@pytest.mark.slow  # ~13 s of two small training runs: CI runs it before any GPU time is spent
def test_the_smoke_run_records_every_part_measured_or_skipped_with_why(tmp_path):
    process, out = run_smoke(tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    printed = json.loads(process.stdout.strip().splitlines()[-1])
    written = json.loads((out / "gpu_check.json").read_text())
    assert printed["parts"] == written["parts"] and written["smoke"] is True
    parts = written["parts"]
    assert tuple(parts) == PARTS
    for name, part in parts.items():
        assert part["status"] in ("measured", "skipped"), (name, part)
        assert part["status"] == "measured" or part["reason"], (name, part)

    environment = parts["environment"]
    assert environment["torch"] and environment["matmul"]["tflops"] > 0
    assert environment["torch_compat"].endswith("private symbols resolve")
    assert environment["packages"]["ray"] == "not installed"  # the lent machine's case

    runs = parts["throughput"]["runs"]
    for side in ("ours", "reference"):
        run = runs[f"debug/eager/{side}"]
        assert run["status"] == "measured", run
        assert run["tokens_per_s"] > 0 and run["steps"] == 4
        assert 4.0 < run["losses"][0] < 7.0  # ln(256) = 5.5: both models start untrained on the same tokens
    assert parts["throughput"]["comparisons"]["debug/eager/ours_over_reference_tokens_per_s"] > 0
    assert parts["throughput"]["reference"]["why_not_torchtitan"]
    for mode in ("compiled", "compiled_float8"):
        assert runs[f"debug/{mode}/ours"]["status"] == "skipped"

    assert "CUDA" in parts["memory"]["reason"]
    assert parts["memory"]["shapes"]["debug"]["estimate"]["total_gb"] > 0  # the planner's side ran
    states = parts["checkpoint"]["states"]
    assert set(states) == {"1.5B", "8B"}
    for state in states.values():
        assert state["stall_s"] > 0 and state["cadence_interval_steps"] >= 1
    assert "ray" in parts["ray"]["reason"]


def test_a_part_that_no_longer_fits_the_budget_is_skipped_with_why(tmp_path):
    process, out = run_smoke(tmp_path, "--budget-s", "12")
    assert process.returncode == 0, process.stderr[-3000:]
    parts = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert tuple(parts) == PARTS
    assert parts["ray"]["status"] == "skipped" and "budget" in parts["ray"]["reason"]


def test_a_wheels_folder_without_wheels_is_refused_in_one_line(tmp_path):
    process, _ = run_smoke(tmp_path, "--wheels", str(tmp_path), wheels=True)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [
        f"bench/gpu_check.py: --wheels {tmp_path}: no .whl files there; "
        "fetch them with python bench/support/gpu_wheels.py"
    ]


def test_ray_repacked_for_the_carry_limit_unpacks_without_what_a_headless_job_never_loads(tmp_path):
    from bench.gpu_check import unpack_wheels
    from bench.support.gpu_wheels import RAY_DROPPED, repack

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl"
    members = {
        "ray/__init__.py": 0o644,
        "ray/core/src/ray/raylet/raylet": 0o755,
        "ray/jars/ray_dist.jar": 0o644,
        "ray/dashboard/client/build/index.html": 0o644,
        "ray/data/tests/test_map.py": 0o644,
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, mode in members.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, b"x" * 1000)
    repack(wheel, RAY_DROPPED)
    unpack_wheels(wheels, tmp_path / "site")
    kept = sorted(str(path.relative_to(tmp_path / "site")) for path in (tmp_path / "site").rglob("*") if path.is_file())
    assert kept == ["ray/__init__.py", "ray/core/src/ray/raylet/raylet"]
    assert os.access(tmp_path / "site/ray/core/src/ray/raylet/raylet", os.X_OK)  # Ray starts its binaries
