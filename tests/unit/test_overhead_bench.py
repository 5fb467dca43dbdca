"""bench/overhead.py's input checks: a bad override or config file is one line and exit 2,
before any run starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.jobs import REPO


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (
            ["--set", "nosuch.key=1"],
            "bench/overhead.py: invalid config: nosuch: unknown key; known keys: name, model, parallelism, "
            "training, data, eval, checkpoint, elastic, metrics, runtime, tracking",
        ),
        (
            ["--set", "novalue"],
            "bench/overhead.py: invalid config: --set 'novalue': expected dotted.key=value, "
            "e.g. --set parallelism.tp=4",
        ),
    ],
)
def test_a_bad_override_exits_2_with_one_line(arguments: list[str], line: str):
    process = subprocess.run(
        [sys.executable, "bench/overhead.py", "--quick", *arguments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 2
    assert process.stderr.strip().splitlines() == [line]


def test_the_summary_sets_each_start_against_torchrun_measured_in_the_same_rounds():
    from bench.overhead import summarize

    phases = {"compute_s": 0.2}
    runs = {
        "torchrun": {"step_s": [0.20, 0.22, 0.21], "first_step_s": [4.0, 4.4, 4.2], "phases": [phases] * 3},
        "meshpilot": {"step_s": [0.21, 0.22, 0.22], "first_step_s": [8.0, 9.0, 8.5], "phases": [phases] * 3},
        # The runs on a running cluster are too short for a steady step time.
        "on_cluster": {"step_s": [], "first_step_s": [5.0, 6.0, 5.5], "phases": []},
        # torchrun beside an idle Ray job: the reference for what Ray's presence costs.
        "torchrun_beside_ray": {"step_s": [0.21, 0.22, 0.22], "first_step_s": [4.1, 4.5, 4.3], "phases": [phases] * 3},
    }
    summary = summarize(runs, [7, 8, 9], world_size=2, steps=120, rounds=3)
    assert summary["first_step_extra_s"] == 4.3  # medians: 8.5 - 4.2
    assert summary["on_cluster_first_step_s"] == 5.5
    assert summary["on_cluster_first_step_extra_s"] == 1.3
    assert summary["per_round"]["on_cluster_first_step_s"] == [5.0, 6.0, 5.5]
    assert "on_cluster_step_s" not in summary["per_round"]
    assert summary["torchrun_beside_ray_step_s"] == 0.22
    # meshpilot's rounds equal torchrun's beside Ray: all of the gap is Ray being there.
    assert summary["step_time_ratio_beside_ray"] == 1.0
    assert summary["ray_presence_ratio"] == summary["step_time_ratio"]
    assert set(summary["phases_s"]) == {"torchrun", "meshpilot", "torchrun_beside_ray"}
    assert (summary["world_size"], summary["steps"], summary["rounds"]) == (2, 120, 3)


@pytest.mark.parametrize(("rounds", "quantile"), [(3, 4.303), (12, 2.201), (31, 2.042), (40, 2.042)])
def test_the_ratio_interval_uses_students_t_for_the_rounds_run(rounds: int, quantile: float):
    import math
    import statistics

    from bench.overhead import ratio_interval

    ours = [1.0 + 0.01 * (i % 5) for i in range(rounds)]
    logs = [math.log(value) for value in ours]
    half = quantile * statistics.stdev(logs) / math.sqrt(rounds)
    centre, low, high = ratio_interval(ours, [1.0] * rounds)
    assert centre == pytest.approx(math.exp(statistics.fmean(logs)))
    assert (low, high) == pytest.approx((centre * math.exp(-half), centre * math.exp(half)))
