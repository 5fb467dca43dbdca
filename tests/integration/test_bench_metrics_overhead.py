"""bench/metrics_overhead.py still runs against the current driver: a short A/B run on the session cluster."""

from __future__ import annotations

import math
import statistics

from bench.metrics_overhead import (
    DEFAULT_JOB,
    DEFAULT_STEPS,
    QUICK_STEPS,
    driver_cost,
    paired_ratio,
    parse_args,
    run_ab,
)
from orchestrator.config import config_from_dict


def test_the_overhead_benchmark_runs_a_real_ab_run(ray_cluster):
    config = config_from_dict({**DEFAULT_JOB, "training": {**DEFAULT_JOB["training"], "steps": 8}})
    assert config.metrics.enabled is False  # "off" blocks must run without the run's own exporter
    ab = run_ab(config, block=2, scrape_interval_s=0.2)
    assert ab["steps"] == 8 and ab["world_size"] == 2
    assert len(ab["on"]) == 2 and len(ab["off"]) == 4  # steps 3-8: on 5-6, off 3-4 and 7-8
    assert all(seconds > 0 for seconds in ab["on"] + ab["off"])
    assert ab["paired_ratio"] > 0 and not math.isnan(ab["paired_ratio"])
    cost = driver_cost(config, 1024, repeats=5)
    assert cost["event_us"] > 0 and cost["scrape_ms"] > 0


def test_paired_ratio_compares_each_on_block_with_the_off_block_after_it():
    def on(step: int) -> bool:
        return ((step - 1) // 2) % 2 == 0

    times = {3: 1.0, 4: 1.0, 5: 2.2, 6: 2.2, 7: 2.0, 8: 2.0, 9: 3.3, 10: 3.3, 11: 3.0, 12: 3.0}
    steps = [{"step": step, "step_time_s": seconds} for step, seconds in times.items()]
    assert paired_ratio(steps, block=2, is_on=on) == statistics.median([2.2 / 2.0, 3.3 / 3.0])


def test_quick_is_a_short_run_and_steps_still_win():
    assert (parse_args([]).steps, parse_args(["--quick"]).steps) == (DEFAULT_STEPS, QUICK_STEPS)
    assert parse_args(["--quick", "--steps", "40"]).steps == 40
