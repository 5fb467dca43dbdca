"""The goodput simulator: Llama 3's reported reliability, the Young/Daly optimum, each policy's rules.

Pure and seeded; a few seconds in all. Run: python -m pytest tests/unit/test_simulator.py -q
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from elastic.simulator import (
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    SimulationInputs,
    default_mttf_hours,
    simulate,
    sweep,
    young_daly_interval_s,
)
from orchestrator.analysis.bench_figures import FORMAT, load_figures, record_figure
from orchestrator.cli import main

DAY = 86400.0


def scenario(**changes) -> SimulationInputs:
    base = SimulationInputs(
        gpus=1024,
        mttf_s=4 * 3600,
        horizon_s=20 * DAY,
        checkpoint_interval_s=600,
        checkpoint_stall_s=10,
        restart_s=300,
        inplace_recovery_s=60,
        drain_s=30,
        grow_s=30,
        replace_s=900,
        replicas=8,
        step_s=10,
    )
    return replace(base, **changes)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_llama3_reliability_gives_above_90_percent_and_in_place_recovery_more(capsys):
    # The Llama 3 Herd of Models: 419 unexpected interruptions in 54 days on 16,384 H100s,
    # restart from checkpoint, > 90% effective training time.
    code, out, _ = run_cli(
        capsys,
        "--gpus",
        str(LLAMA3_GPUS),
        "--interruptions",
        str(LLAMA3_INTERRUPTIONS),
        "--days",
        str(LLAMA3_DAYS),
        "--bench-results",
        "none",
        "--json",
    )
    assert code == 0
    document = json.loads(out)
    policies = document["policies"]
    assert document["inputs"]["mttf_s"] == pytest.approx(54 * 86400 / 419)
    restart, shrink, drain = policies["restart"], policies["shrink"], policies["drain"]
    assert restart["best_goodput"] > 0.90
    assert restart["best"]["restores"] == pytest.approx(419, rel=0.15)
    assert shrink["best_goodput"] > restart["best_goodput"] + 0.03
    assert shrink["at_young_daly"]["goodput"] > restart["at_young_daly"]["goodput"]
    assert shrink["best"]["restores"] == 0  # 128 replica groups: a failure never takes them all
    assert drain["best_goodput"] == shrink["best_goodput"]  # no spot notices: drain has nothing to drain
    # The simulated optimum for restart-from-checkpoint sits where Young/Daly puts it.
    assert restart["best_interval_s"] == pytest.approx(document["young_daly_interval_s"], rel=0.35)


def test_the_simulation_is_deterministic_per_seed():
    inputs = scenario(preemptions_per_day=2)
    assert simulate(inputs, "drain", seed=3) == simulate(inputs, "drain", seed=3)
    assert simulate(inputs, "drain", seed=3) != simulate(inputs, "drain", seed=4)


def test_without_failures_only_checkpoint_stalls_cost_time():
    result = simulate(scenario(mttf_s=1e15, horizon_s=DAY), "restart")
    assert result.failures == 0
    assert result.goodput == pytest.approx(600 / 610, abs=1e-3)


def test_restart_goodput_matches_the_first_order_model():
    inputs = scenario(horizon_s=200 * DAY)
    goodput = sum(simulate(inputs, "restart", trial=t).goodput for t in range(3)) / 3
    interval, stall, mttf, restart = 600, 10, 4 * 3600, 300
    # Per failure: half a cycle of work and a restart are lost; every cycle pays a stall.
    expected = (1 - stall / (interval + stall)) * (1 - ((interval + stall) / 2 + restart) / mttf)
    assert goodput == pytest.approx(expected, abs=0.01)


def test_young_daly_interval_is_near_the_simulated_best_for_restart():
    inputs = scenario(horizon_s=60 * DAY)
    result = sweep(inputs, policies=("restart",), trials=3)
    assert result.young_daly_s == pytest.approx(young_daly_interval_s(10, 4 * 3600))
    assert result.curves[0].best_interval_s == pytest.approx(result.young_daly_s, rel=0.5)
    assert result.curves[0].at_young_daly.goodput == pytest.approx(result.curves[0].best_goodput, abs=0.005)


def test_shrink_with_one_replica_is_a_restart():
    inputs = scenario(replicas=1)
    assert simulate(inputs, "shrink").goodput == simulate(inputs, "restart").goodput


def test_shrink_falls_back_to_restore_below_min_replicas():
    inputs = scenario(replicas=2, min_replicas=2)
    result = simulate(inputs, "shrink")
    assert result.restores == result.failures > 0


def test_drain_turns_spot_notices_into_lossless_shrinks():
    inputs = scenario(mttf_s=1e15, preemptions_per_day=6)
    drained = simulate(inputs, "drain")
    shrunk = simulate(inputs, "shrink")
    restarted = simulate(inputs, "restart")
    # Notices land on GPUs in the job, so a shrunk job sees a few fewer.
    assert restarted.preemptions >= max(drained.preemptions, shrunk.preemptions) > 50
    assert drained.restores == 0 and drained.goodput > shrunk.goodput > restarted.goodput
    # A notice too short to finish the step is treated like a failure when the node goes.
    late = simulate(replace(inputs, notice_s=5), "drain")
    assert late.goodput == pytest.approx(simulate(replace(inputs, notice_s=5), "shrink").goodput)


def test_drain_of_the_last_replica_checkpoints_first_and_loses_nothing():
    inputs = scenario(mttf_s=1e15, preemptions_per_day=4, replicas=1)
    drained = simulate(inputs, "drain")
    restarted = simulate(inputs, "restart")
    # Every notice restarts the job (one arriving while it already restarts rides along).
    assert 0 < drained.preemptions - 2 <= drained.restores <= drained.preemptions
    assert drained.lost_work_s == 0 and restarted.lost_work_s > 0


def test_default_mttf_follows_metas_two_points():
    assert default_mttf_hours(1024) == pytest.approx(7.9)
    assert default_mttf_hours(16384) == pytest.approx(1.8)
    assert default_mttf_hours(8) == pytest.approx(7.9 * 128)  # per-GPU rate of the 1,024-GPU point
    assert default_mttf_hours(32768) == pytest.approx(0.9)  # per-GPU rate of the 16,384-GPU point
    assert 1.8 < default_mttf_hours(4096) < 7.9


def test_bench_figures_replace_defaults_and_the_output_says_so(capsys, tmp_path):
    results = tmp_path / "latest.json"
    record_figure(results, "inplace_recovery_s", 2.5, bench="bench/recovery.py", world_size=8)
    record_figure(results, "checkpoint_stall_s", 0.4, bench="bench/checkpoint_stall.py", world_size=8)
    assert json.loads(results.read_text())["format"] == FORMAT
    assert set(load_figures(results)) == {"inplace_recovery_s", "checkpoint_stall_s"}
    code, out, _ = run_cli(capsys, "--gpus", "1024", "--days", "10", "--trials", "1", "--bench-results", str(results))
    assert code == 0
    assert re.search(r"inplace_recovery_s +2\.50 s  \[measured \(bench/recovery\.py, 8 ranks, \d{4}-", out)
    assert re.search(r"checkpoint_stall_s +0\.40 s  \[measured \(bench/checkpoint_stall\.py, 8 ranks, ", out)
    assert re.search(r"restart_s +300\.00 s  \[default: ", out)
    # A flag beats the measured figure.
    code, out, _ = run_cli(
        capsys, "--gpus", "1024", "--days", "10", "--trials", "1", "--bench-results", str(results), "--inplace-s", "7"
    )
    assert re.search(r"inplace_recovery_s +7\.00 s  \[--inplace-s\]", out)


def test_missing_bench_results_fall_back_to_documented_defaults(capsys, tmp_path):
    code, out, _ = run_cli(
        capsys, "--gpus", "1024", "--days", "5", "--trials", "1", "--bench-results", str(tmp_path / "absent.json")
    )
    assert code == 0
    assert "failures: MTTF 7.90 h (Meta reliability study (7.9 h at 1,024 GPUs, 1.8 h at 16,384), scaled" in out
    assert re.search(r"checkpoint_stall_s +10\.00 s  \[default: async sharded checkpoint", out)


def test_plot_is_a_small_png(capsys, tmp_path):
    target = tmp_path / "plots" / "goodput.png"
    code, out, _ = run_cli(
        capsys,
        "--gpus",
        "16384",
        "--interruptions",
        "419",
        "--days",
        "54",
        "--trials",
        "1",
        "--bench-results",
        "none",
        "--plot",
        str(target),
    )
    assert code == 0 and f"plot: {target}" in out
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 200_000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "0"], "meshpilot: --gpus=0 must be >= 1\n"),
        (["--interruptions", "419"], "meshpilot: --interruptions needs --days: the window they were counted over\n"),
        (
            ["--gpus", "1000", "--replica-gpus", "128"],
            "meshpilot: --replica-gpus=128 must divide --gpus=1000 (the job is a whole number of replica groups)\n",
        ),
        (
            ["--stall-s", "-1", "--bench-results", "none"],
            "meshpilot: --stall-s: checkpoint_stall_s=-1.0 must be >= 0\n",
        ),
        (
            ["--checkpoint-interval-min", "1", "--upload-s", "90", "--bench-results", "none"],
            "meshpilot: --upload-s=90 exceeds the checkpoint interval (60 s): one upload must finish before the next "
            "starts\n",
        ),
    ],
)
def test_bad_simulate_flags_give_one_clear_line_and_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and err == message and out == ""


def test_a_malformed_bench_file_is_named_with_the_fix(capsys, tmp_path):
    broken = tmp_path / "latest.json"
    broken.write_text('{"figures": []}')
    code, _, err = run_cli(capsys, "--bench-results", str(broken))
    assert code == 2
    assert err == (
        f'meshpilot: bench results {broken} is not a {FORMAT} file (want {{"format": "{FORMAT}", '
        '"figures": {...}}); re-run the benchmark or pass --bench-results none\n'
    )
